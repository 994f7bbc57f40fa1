"""What an implementation may touch: copies of its case's inputs, never the case itself, and no
process-wide torch setting.

A case carries the oracle's outputs in its cache and is shared by every row of a run, so every
implementation receives its own copy of the inputs (:func:`case_for`); one that is not k3verify's
own gets a :func:`sealed` copy (no cache either). What an implementation writes into the inputs
it was given, or returns in their memory, is its failure (:class:`InputMutated`), checked twice:
on the case it received (:func:`run_isolated`) and, inside each module's adapter, on the tensors a
function is called with (:func:`checked_call`) - the cast copies a kernel really sees.
Process-wide torch settings (default dtype, flush-to-zero, TF32, thread count...) change the
results of every later computation, the oracle's included; :func:`torch_state` records them
around each call and :func:`restore` puts back what a call changed, which the caller reports as
that call's failure.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..numerics import bit_pattern, held, named_tensors
from .contract import BUILTIN_SOURCE, Case, Implementation


def sealed(case: Case) -> Case:
    """A copy of ``case`` for an implementation: deep-copied inputs and parameters, empty cache
    (which holds the oracle's and baselines' outputs)."""
    return Case(case.name, copy.deepcopy(case.inputs), copy.deepcopy(case.params))


def case_for(impl: Implementation, case: Case) -> Case:
    """What ``impl`` receives: its own copy of the inputs. k3verify's own forms share the cache
    (the exact quantities their predictions read); every other implementation gets a
    :func:`sealed` copy."""
    if impl.source == BUILTIN_SOURCE:
        return Case(case.name, copy.deepcopy(case.inputs), case.params, case.cache)
    return sealed(case)


class InputMutated(RuntimeError):
    """An implementation wrote into an input it was given, or returned memory of one: in a
    kernel, a caller's tensor changed behind its back."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def _change(name: str, before: torch.Tensor, after: torch.Tensor) -> str | None:
    """How ``after`` differs from its copy ``before`` (taken before the call), or None."""
    if (after.shape, after.dtype, after.device) != (before.shape, before.dtype, before.device):
        return (f"changed its input {name} from {before.dtype} {tuple(before.shape)} on {before.device} "
                f"to {after.dtype} {tuple(after.shape)} on {after.device}")
    if after.is_meta or after.numel() == 0:
        return None
    changed = int((bit_pattern(before) != bit_pattern(after)).sum())
    return f"modified its input {name} in place ({changed} of {after.numel()} elements changed)" if changed else None


def _span(t: torch.Tensor) -> tuple[str, int, int] | None:
    if t.is_meta:
        return None
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr(), storage.data_ptr() + storage.nbytes()) if storage.nbytes() else None


def _aliases(result: Any, inputs: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Each returned tensor that shares memory with one of ``inputs``, named."""
    spans = [(name, s) for name, t in inputs if (s := _span(t)) is not None]
    found = []
    for out_name, out in named_tensors(result, "result"):
        o = _span(out)
        for in_name, i in spans:
            if o is not None and o[0] == i[0] and o[1] < i[2] and i[1] < o[2]:
                found.append(f"returned {out_name} in the memory of its input {in_name} (an output must be "
                             "a tensor of its own)")
                break
    return found


def _named(values: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return [pair for name, value in values.items() for pair in named_tensors(value, name)]


def checked_call(fn: Callable[..., Any], args: Sequence[Any], names: Sequence[str], kwargs: Mapping[str, Any],
                 *, writable: Collection[str] = (), returnable: Collection[str] = ()) -> Any:
    """``fn(*args, **kwargs)``, then :class:`InputMutated` if it changed a tensor it was given or
    returned one's memory. ``names`` name the positional ``args``; keyword arguments are named by
    their keys; ``writable`` names arguments ``fn`` may write into and return (a paged cache),
    ``returnable`` those it may hand back unchanged (MoE's routing, whose indices are the experts
    a kernel reports). Every tensor is copied before the call: one copy of the arguments."""
    given = {n: v for n, v in zip(names, args) if n not in writable}
    given |= {n: v for n, v in kwargs.items() if n not in writable}
    watched = _named(given)
    # A cast kept by held_casts (a walk's weights, the same at every call of a job) is checked
    # once at the job's end instead: copied and compared here, a wide MoE layer's 448 M weights
    # took about 1 s of the host at each of a scenario's hundreds of calls.
    before = [None if held(t) else t.detach().clone() for _, t in watched]
    result = fn(*args, **kwargs)
    problems = [p for (name, t), b in zip(watched, before) if b is not None and (p := _change(name, b, t))]
    problems += _aliases(result, [(name, t) for name, t in watched if name.partition(".")[0] not in returnable])
    if problems:
        raise InputMutated(problems)
    return result


def gradients_by_name(result: Any, module: str, outputs: Sequence[str]) -> dict[str, Any]:
    """A backward's ``result`` as the dict of gradients it must be; ``TypeError`` naming the
    ``module`` (``"a KDA"``), its gradients and what came back otherwise."""
    if not isinstance(result, Mapping):
        raise TypeError(f"{module} backward returns its gradients by name ({', '.join(outputs)}); "
                        f"this one returned a {type(result).__name__}")
    return dict(result)


def run_isolated(impl: Implementation, case: Case) -> Any:
    """``impl.run`` on its own copy of ``case`` (:func:`case_for`), under :func:`guarded`; then
    :class:`InputMutated` if the copy's inputs differ from the case's or the result shares their
    memory. The case itself is never handed out, so a failing implementation leaves every later
    row's inputs as they were."""
    given = case_for(impl, case)
    result = guarded(impl.label, lambda: impl.run(given))
    original, received = dict(_named(case.inputs)), dict(_named(given.inputs))
    problems = [f"removed or replaced its input {name}" for name in original if name not in received]
    problems += [p for name, t in original.items() if name in received and (p := _change(name, t, received[name]))]
    problems += _aliases(result, list(received.items()))
    if problems:
        raise InputMutated(problems)
    return result


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
    # Autocast left on makes every later matmul of the process run in its dtype.
    out += [Setting(f"autocast {device}", lambda d=device: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)),
                    lambda value, d=device: _set_autocast(d, *value)) for device in ("cpu", "cuda")]
    out.append(Setting("autocast cache", torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled))
    # The newer per-backend precision settings (torch 2.9 and later): once one is set, the older
    # getter above raises instead of answering, so each is read and put back itself.
    out += [Setting(f"{path}.fp32_precision", _reader(path), _writer(path)) for path in FP32_PRECISION_PATHS]
    return out


FP32_PRECISION_PATHS = ("backends", "backends.cuda.matmul", "backends.cudnn", "backends.cudnn.conv",
                        "backends.cudnn.rnn", "backends.mkldnn", "backends.mkldnn.matmul", "backends.mkldnn.conv",
                        "backends.mkldnn.rnn")


def _owner(path: str) -> Any:
    obj: Any = torch
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _reader(path: str) -> Callable[[], Any]:
    return lambda: _owner(path).fp32_precision


def _writer(path: str) -> Callable[[Any], None]:
    def write(value: Any) -> None:
        _owner(path).fp32_precision = value

    return write


def _set_autocast(device: str, enabled: bool, dtype: torch.dtype) -> None:
    torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_enabled(device, enabled)


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
    changed = [f"{s.name}: {before[s.name]} -> {now.get(s.name)}" for s in SETTINGS
               if s.name in before and now.get(s.name) != before[s.name]]
    # Some settings move others when written (the older matmul precision sets the newer CUDA
    # one): write again until nothing differs, a pass per setting at most.
    for _ in SETTINGS:
        differ = [s for s in SETTINGS if s.name in before and now.get(s.name) != before[s.name]]
        if not differ:
            return changed
        for s in differ:
            with contextlib.suppress(Exception):
                s.write(before[s.name])
        now = torch_state()
    # Named, so the report says the process is no longer clean.
    return changed + [f"{s.name} could not be restored to {before[s.name]}" for s in SETTINGS
                      if s.name in before and now.get(s.name) != before[s.name]]


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

"""Structure-preserving maps over the tensors inside a value: dataclasses (weights, configs,
caches), tuples, lists and dicts, as the sharded forms send them between processes and
devices. Non-tensor leaves are returned as they are."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def map_tensors(value: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """``value`` with ``fn`` applied to every tensor in it (dataclass fields that are set in
    ``__init__``, tuple/list items, dict values), rebuilt with the same types."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        return type(value)({k: map_tensors(v, fn) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def cast_floats(value: T, dtype: torch.dtype) -> T:
    """``value`` with every floating-point tensor cast to ``dtype`` (integer tensors kept)."""
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def named_tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``value`` with its path from ``name`` (``cache.pool``, ``weights[2]``,
    ``x['a']``): the containers :func:`map_tensors` walks, every dataclass field and namedtuples too."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from named_tensors(getattr(value, f.name, None), f"{name}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from named_tensors(v, f"{name}[{k!r}]")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for field, v in zip(value._fields, value):
            yield from named_tensors(v, f"{name}.{field}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from named_tensors(v, f"{name}[{i}]")


@dataclasses.dataclass(frozen=True)
class Stamp:
    """One tensor object at one version: a weak reference (a new tensor at a recycled ``id`` is
    not taken for it) and its version counter (an in-place write moves it). What a cache of
    values handed unchanged from call to call keys on."""

    ref: weakref.ref
    version: int

    @classmethod
    def of(cls, t: torch.Tensor, gone: Callable[[Any], object] | None = None) -> Stamp | None:
        """``t``'s stamp (``gone`` called when ``t`` dies), or ``None`` for a tensor that has no
        version counter (made in inference mode) or takes no weak reference: such a tensor
        cannot be told unchanged, and is treated as new every time."""
        if t.is_inference():  # reading its version would raise
            return None
        try:
            return cls(weakref.ref(t, gone), t._version)
        except TypeError:  # a tensor subclass without weak references
            return None

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the stamped object, unwritten since."""
        return self.ref() is t and not t.is_inference() and self.version == t._version


class Casts:
    """``t.to(device, dtype)`` made once per source tensor and kept while the source lives: for
    values handed unchanged to call after call (a walk's weights). A cast is made again when its
    source or the cast itself was written in place (either's version counter moved), so a caller
    that scribbles on what it was given never hands the next call its leftovers. With ``copy`` a
    source already in that dtype and place is copied too (a result never aliases its source);
    else it is returned as ``.to`` would. Inference tensors (no version counter) are cast every
    time, and a tensor that requires grad is cast as ``.to`` casts it (its graph kept)."""

    def __init__(self, *, copy: bool = False) -> None:
        self.copy = copy
        # (id(source), dtype, device) -> (the source's stamp, the cast, the cast's version)
        self._made: dict[tuple[int, torch.dtype, torch.device], tuple[Stamp, torch.Tensor, int]] = {}
        self._key_of: dict[int, tuple[int, torch.dtype, torch.device]] = {}  # id(cast) -> its key in _made

    def __call__(self, t: torch.Tensor, dtype: torch.dtype, device: torch.device | str | None = None, *,
                 copy: bool | None = None) -> torch.Tensor:
        """``t`` on ``device`` (default: its own) in ``dtype``; ``copy`` (default: the one given
        at construction) says whether a source already in that dtype and place is copied."""
        device = _place(t, device)
        copy = self.copy if copy is None else copy
        if not copy and t.dtype == dtype and t.device == device:
            return t  # as .to: nothing to make
        if t.is_inference() or t.requires_grad:  # no version to trust; a graph to keep
            return t.to(device, dtype, copy=copy)
        key = (id(t), dtype, device)
        kept = self._made.get(key)
        if kept is not None and kept[0].holds(t) and kept[2] == kept[1]._version:
            return kept[1]
        out = t.detach().to(device, dtype, copy=copy)
        # The source's death drops its cast. Held weakly (:func:`weakly`): through this object
        # the callback would make a cycle, and the casts (gigabytes at K3's widths) would live
        # until the cyclic collector ran, at a time no one can predict.
        stamp = Stamp.of(t, weakly(self._drop, key))
        if stamp is not None:
            self._made[key] = (stamp, out, out._version)
            self._key_of[id(out)] = key
        return out

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of the casts kept here, as it was made (no in-place write seen).
        Asked of every tensor a guarded call is given, so a lookup, not a scan."""
        kept = self._made.get(self._key_of.get(id(t)))  # type: ignore[arg-type]
        return kept is not None and kept[1] is t and kept[2] == t._version

    def changed(self) -> list[str]:
        """The kept casts whose values differ from their living source's cast although no
        in-place write was seen (their version counter did not move): memory written behind
        torch's back, as a kernel writes through a pointer. A write torch saw is harmless (the
        next call gets a cast made again) and is not listed. One cast and compare per kept cast.
        A cast whose source died went with it and is not compared: what is cast inside a walk's
        job (the stack's weights, and the copies of them kept here) lives until the job's end."""
        found = []
        for stamp, out, out_version in list(self._made.values()):
            source = stamp.ref()
            if source is None or not stamp.holds(source) or out._version != out_version:
                continue
            fresh = source.detach().to(out.device, out.dtype, copy=True)
            if not torch.equal(bit_pattern(fresh), bit_pattern(out)):
                found.append(f"the {str(out.dtype).removeprefix('torch.')} {list(out.shape)} copy on {out.device}")
        return found

    def _drop(self, key: tuple[int, torch.dtype, torch.device]) -> None:
        """A source's death: its cast goes."""
        self._made.pop(key, None)


def weakly(method: Callable[..., object], *args: Any) -> Callable[[Any], None]:
    """A weak reference's death callback that calls ``method(*args)`` (a bound method) unless
    its object died first. The object is held weakly: a record of stamps (:class:`Stamp`) whose
    callbacks held it would sit in a cycle with them, freed only when the cyclic collector
    runs."""
    return functools.partial(_call_weakly, weakref.WeakMethod(method), args)


def _call_weakly(method: weakref.WeakMethod, args: tuple[Any, ...], _dead: object) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and read as integers of its element size, so that a NaN equals itself and
    -0.0 differs from 0.0: two tensors are equal in it exactly when every bit is."""
    flat = t.detach().reshape(-1)
    size = t.element_size()
    return flat.view(_SAME_SIZE_INTS[size]) if size in _SAME_SIZE_INTS else flat


def _place(t: torch.Tensor, device: torch.device | str | None) -> torch.device:
    """``device`` as the tensor's own device when it names the same place (``"cuda"`` for a
    tensor on ``cuda:0``: ``torch.device`` equality says they differ), else as given."""
    if device is None:
        return t.device
    device = torch.device(device)
    same_type = device.type == t.device.type
    if same_type and (device.index is None or t.device.index is None or device.index == t.device.index):
        return t.device
    return device


_HELD: list[Casts] = []


@contextlib.contextmanager
def held_casts() -> Iterator[Casts]:
    """Within: :func:`cast_once` keeps its casts (one :class:`Casts` for the block, dropped on
    leaving). Outside, it casts every time, as ``.to`` does: a row's case and its casts go
    together, and a map at K3's widths must not keep every case's device copies."""
    _HELD.append(Casts())
    try:
        yield _HELD[-1]
    finally:
        _HELD.pop()


def held(t: torch.Tensor) -> bool:
    """Whether ``t`` is a cast kept by the innermost :func:`held_casts`, unchanged: what it is
    handed to is checked once at the block's end (:meth:`Casts.changed`), not around each call."""
    return bool(_HELD) and _HELD[-1].holds(t)


def cast_once(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str | None = None, *,
              copy: bool = False) -> torch.Tensor:
    """``t.to(device, dtype, copy=copy)``; inside :func:`held_casts`, made once per unchanged
    source (a copy too: a kept copy is the same tensor at every call, and is checked with the
    casts at the block's end)."""
    if _HELD:
        return _HELD[-1](t, dtype, device, copy=copy)
    return t.to(t.device if device is None else device, dtype, copy=copy)

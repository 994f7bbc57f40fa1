"""Where the Triton kernels of every module run, and the helpers their launchers share.

Importing this module chooses Triton's CPU interpreter (``TRITON_INTERPRET=1``) when no CUDA
device is visible, before Triton is imported (Triton reads the setting then), so every
``kernels.py`` takes ``triton`` and ``tl`` from here instead of importing them. The interpreter
is faithful for fp32 only (it rounds fp32 -> bf16 by truncation and its bf16 ``tl.dot`` is
wrong, docs/model.md §5); :func:`unavailable_reason` says so for the other dtypes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .numerics import dtype_name, resolve_dtype

# Triton decorates its own helpers (tl.cdiv and the rest of triton.language's jit functions) when
# it is imported: imported before the interpreter was chosen, they stay compiled-mode functions,
# and an interpreted kernel that calls one fails ("Cannot call @triton.jit'd outside of the scope
# of a kernel"). :func:`unavailable_reason` names that case.
if not torch.cuda.is_available():
    LANGUAGE_BEFORE_INTERPRETER = "TRITON_INTERPRET" not in os.environ and "triton.language" in sys.modules
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    LANGUAGE_BEFORE_INTERPRETER = False


@contextlib.contextmanager
def _interrupt_held() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside the block until the block ends, then raise it.

    Triton's native library builds Python enums while it loads; a KeyboardInterrupt raised in
    one of them cannot unwind through that C++ code, which aborts the whole process (SIGABRT and
    a C++ message instead of exit 130). Only the main thread, and only where Python's own handler
    is installed (not where a caller ignores or handles SIGINT itself), is changed."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


with _interrupt_held():
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["TensorDescriptor", "block", "check_launch", "device_for", "dot", "dot_fp32", "interpreted",
           "multiprocessors", "profiled", "tl", "tma_descriptor", "triton", "unavailable_reason"]


def tma_descriptor(t: torch.Tensor, block: Sequence[int]) -> TensorDescriptor | None:
    """``t`` (contiguous) as a TMA tensor descriptor of ``block`` tiles, or ``None`` where a TMA
    copy cannot read it: its start or a row not on a 16-byte boundary (the copy engine's rule),
    or a block side over a copy box's 256 elements."""
    size = t.element_size()
    if t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]) or max(block) > 256:
        return None
    return TensorDescriptor.from_tensor(t, list(block))


def interpreted() -> bool:
    """True when the kernels run under Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_once_per_launch() -> bool:
    """Under the interpreter, patch ``triton.language`` once per kernel launch instead of once
    per call of a ``@triton.jit`` helper; True when installed (False: not interpreted, already
    installed, or a Triton whose interpreter lacks the two hooks, which then runs as it is).

    Triton's interpreter (``triton/runtime/interpreter.py``) swaps every builtin of
    ``triton.language`` for its numpy version when a launch starts (``GridExecutor.__call__``,
    undone when it ends) and again, never undone, on every call of a helper inside the kernel
    (``InterpretedFunction.__call__``): the same swap, hundreds of attributes, repeated for each
    ``dot`` or ``exp2`` helper in a loop. A helper whose language modules the running launch has
    swapped already skips it; the swap installs the same numpy builtins either way, so the
    results are bit for bit Triton's own (``properties/test_triton_support.py``). Measured on the
    110 kernel rows of ``k3verify run`` on CPU: 41 s -> 31 s.
    """
    if not interpreted():
        return False
    from triton.runtime import interpreter

    real, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if real is None or executor is None or scope is None or getattr(real, "k3verify_once", False):
        return False
    launches: list[set[int]] = []  # per running launch (innermost last): the swapped modules' ids
    modules_of: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()

    def patch_lang(fn: Any) -> Any:
        modules = modules_of.get(fn)
        if modules is None:
            modules = frozenset(id(v) for v in fn.__globals__.values()
                                if inspect.ismodule(v) and v in (tl, tl.core))
            modules_of[fn] = modules
        if launches and modules and modules <= launches[-1]:
            return scope()  # nothing to undo: the launch's swap is in force
        swapped = patch_lang.real(fn)  # type: ignore[attr-defined]
        if launches:
            launches[-1].update(modules)
        return swapped

    launch = executor.__call__

    def launch_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(set())
        try:
            return launch_once.real(self, *args, **kwargs)  # type: ignore[attr-defined]
        finally:
            launches.pop()

    # Triton's own two, read from the replacements at each call (a test counts them).
    patch_lang.real, launch_once.real = real, launch  # type: ignore[attr-defined]
    patch_lang.k3verify_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch_once
    return True


PATCHED_ONCE_PER_LAUNCH = _patch_once_per_launch()


def unavailable_reason(what: str, dtype: torch.dtype | str, dtypes: tuple[torch.dtype, ...],
                       interpreter_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str | None:  # fmt: skip
    """Why ``what`` (e.g. ``"the KDA kernels"``) cannot give faithful results for ``dtype``
    here, or ``None``; ``dtypes`` are the dtypes it takes at all, ``interpreter_dtypes`` those
    whose every operation the interpreter computes as a GPU does (fp32; fp16 where the kernel
    converts only to fp16, which numpy rounds to nearest even, and multiplies fp16 tiles)."""
    dt = resolve_dtype(dtype)
    if dt not in dtypes:
        names = [dtype_name(d) for d in dtypes]
        listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
        return f"{what} take {listed} operands, not {dtype_name(dt)}"
    if interpreted():
        if LANGUAGE_BEFORE_INTERPRETER:
            return (f"Triton was imported before k3verify chose its CPU interpreter, so Triton's own jit helpers "
                    f"run compiled and {what} cannot run interpreted: import k3verify first, or set "
                    "TRITON_INTERPRET=1 before importing Triton")  # fmt: skip
        if dt not in interpreter_dtypes:
            return (
                f"Triton's CPU interpreter is not faithful for {dtype_name(dt)} (it truncates fp32 -> bf16 and "
                "its bf16 tl.dot is wrong: docs/gpu.md); a CUDA device is needed"
            )
        return None
    if not torch.cuda.is_available():
        return f"{what} need a CUDA device or TRITON_INTERPRET=1; neither is set"
    return None


def block(n: int) -> int:
    """Power-of-two block covering ``n``, at least 16 (the smallest ``tl.dot`` side)."""
    return max(16, triton.next_power_of_2(n))


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A range named ``name`` for the torch profiler while one records, else nothing: an unrecorded
    ``record_function`` still costs about 6 µs, the check 0.3 (torch's own flag, read with a
    default of recording when a torch lacks it)."""
    import torch.autograd.profiler as autograd_profiler

    if getattr(autograd_profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def check_launch(owner: str, sides: dict[str, int], warps: int, stages: int) -> None:
    """``ValueError`` naming ``owner``'s field when a tile side is not a power of two of at least
    16 (a ``tl.dot`` side), ``warps`` is not 1, 2, 4, 8 or 16, or ``stages`` is not 1 to 6."""
    for name, n in sides.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 16 or n & (n - 1):
            raise ValueError(f"{owner}.{name} must be a power of two of at least 16, got {n!r}")
    if isinstance(warps, bool) or not isinstance(warps, int) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{owner}.warps must be 1, 2, 4, 8 or 16, got {warps!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= 6:
        raise ValueError(f"{owner}.stages must be 1 to 6, got {stages!r}")


def device_for(x: torch.Tensor, what: str) -> torch.device:
    """The device ``what`` runs on for input ``x``: its CUDA device, the CPU under the
    interpreter, else the current CUDA device (``RuntimeError`` when there is none)."""
    if x.is_cuda or interpreted():
        return x.device if x.is_cuda else torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(f"no device for {what}: no CUDA device and TRITON_INTERPRET is not set")


def multiprocessors(dev: torch.device) -> int:
    """Streaming multiprocessors of ``dev`` (1 on the CPU)."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1


@functools.cache
def _side_stream(dev: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(dev)


def mark(dev: torch.device) -> torch.cuda.Event | None:
    """An event at the current point of ``dev``'s current stream (``None`` on the CPU)."""
    if dev.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    return event


@contextlib.contextmanager
def beside(dev: torch.device, after: torch.cuda.Event | None) -> Iterator[None]:
    """Launches inside run on a second stream of ``dev``, once ``after`` (a :func:`mark`) has
    passed, concurrently with whatever the current stream runs from then on; a :func:`mark`
    made inside, given to :func:`wait` outside, orders later work after them. With ``after``
    ``None`` (and on the CPU, the interpreter) they run in order on the current stream."""
    if dev.type != "cuda" or after is None:
        yield
        return
    side = _side_stream(dev)
    side.wait_event(after)
    with torch.cuda.stream(side):
        yield


def wait(dev: torch.device, event: torch.cuda.Event | None) -> None:
    """The current stream of ``dev`` waits for ``event`` (a :func:`mark`; nothing on the CPU)."""
    if event is not None:
        torch.cuda.current_stream(dev).wait_event(event)


@triton.jit
def dot(a, b, IEEE: tl.constexpr, acc=None):
    """``acc + a @ b`` (``a @ b`` when ``acc`` is None) with fp32 accumulation; an ``acc`` given
    is the product's own accumulator (no separate add). fp32 operands would silently run as tf32
    on tensor cores; ``IEEE`` keeps them fp32 (the interpreter, fp32 rows). 16-bit operands are
    exact either way."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def dot_fp32(a, b, IEEE: tl.constexpr):
    """``a @ b`` of fp32 operands at about fp32 accuracy: exact products with ``IEEE`` (the
    interpreter, fp32 rows), else tf32x3 on tensor cores (each operand split into a tf32 head and
    tail; about 22 bits kept, and a bf16 or fp16 value is exact in the head)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32x3")

"""Plugins run in a process of their own.

A plugin is code from another package, judged by k3verify; it must not be able to change the
verdict. So k3verify never imports a plugin: one worker process per plugin package (forked from
a process that imported torch once, :mod:`.zygote`) loads the entry points and runs their
implementations, and the harness holds a *proxy* :class:`~k3verify.harness.registry.Implementation`
for each, whose ``run``, ``predict``, ``explain`` and ``map_points`` are requests to the worker.
What that buys:

- the oracle, the baselines, the policy and the cases live in the harness's process; the worker
  receives copies of a case's inputs and parameters (never its cache, which holds the oracle's
  outputs) and sends back tensors only, read with ``torch.load(weights_only=True)`` so no
  object of the plugin's making is ever built in the harness;
- patching ``k3verify`` or flipping process-wide torch settings in the worker changes nothing
  in the harness; the worker also restores settings after every call and fails the call that
  changed them, so one plugin cannot move another's results;
- ``sys.exit``, ``os._exit``, a segfault or a hang end one request: the request fails with its
  reason (its row is a failed verdict), a hang after the timeout (``--timeout``, default
  :data:`DEFAULT_TIMEOUT_S` per request) by killing the worker's process group; the next request
  starts a fresh worker, which loads the plugin again and must register the same
  implementations;
- what the worker prints reaches stderr line by line with control characters made visible.

Frames are an 8-byte little-endian length and a payload: pickles from the harness (the worker
trusts the harness), ``torch.save`` documents from the worker (the harness trusts nothing).
A large input that the harness sends again, the same tensor unchanged (a walk's weights, call
after call), crosses the pipe twice only: the second message asks the worker to keep it for that
plugin and later ones name it (:data:`KEEP_MIN_BYTES`, :data:`KEEP_MAX_BYTES`). Kept inputs are
never handed out: every call gets its own copy, so a plugin that writes into them changes no
later call.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..numerics.policy import BASELINE_RULE, RULES
from ..numerics.tensors import Stamp, weakly
from . import zygote
from .contract import (
    PLUGIN_GROUP,
    Case,
    Implementation,
    Outputs,
    Peer,
    Prediction,
    as_outputs,
)
from .guard import case_for, restore, run_isolated, sealed, torch_state
from .text import terminal_text

DEFAULT_TIMEOUT_S = 900.0
STARTUP_TIMEOUT_S = 600.0  # a worker's imports, before any request; generous for a loaded machine
MAX_FRAME_BYTES = 1 << 34  # 16 GiB: a production-shape output fits, a garbage length does not
_HEADER = struct.Struct("<Q")
_timeout_s = DEFAULT_TIMEOUT_S
# Inputs the harness hands a plugin call after call (a walk's weights: 3.6 GB in fp64 for one wide
# MoE layer) cross the pipe twice, not at every call: a tensor of at least KEEP_MIN_BYTES that a
# message holds again, the same object unchanged, is kept by the worker for that plugin and later
# messages name it. Up to KEEP_MAX_BYTES a plugin, the least recently used dropped first.
KEEP_MIN_BYTES = 1 << 20
KEEP_MAX_BYTES = 16 << 30


class PluginError(RuntimeError):
    """A request to the plugin process that did not return a result; the message says why."""


def set_timeout(seconds: float) -> None:
    """Seconds one request to the plugin process may take (``k3verify run --timeout``)."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError(f"a timeout is a positive number of seconds, not {seconds!r}")
    _timeout_s = float(seconds)


def timeout() -> float:
    return _timeout_s


# --- frames --------------------------------------------------------------------------------


def _write_frame(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd``; ``None`` at end of file; ``TimeoutError`` past ``deadline``."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None = None) -> bytes | None:
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        return None
    (length,) = _HEADER.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise PluginError(f"the plugin process sent a frame of {length} bytes")
    return _read_exact(fd, length, deadline)


def _document(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# --- inputs kept in the worker ----------------------------------------------------------------


@dataclass
class _Seen:
    stamp: Stamp
    nbytes: int
    token: int | None = None  # kept by the worker under this number; None: sent in the message


class _Kept:
    """The harness's record of the tensors the worker keeps for one plugin (entry point): each
    large tensor a message held, by its :class:`~k3verify.numerics.tensors.Stamp` (an in-place
    change makes it another input; a tensor without one, made in inference mode, is sent in
    every message)."""

    def __init__(self) -> None:
        self.seen: dict[int, _Seen] = {}
        self.order: OrderedDict[int, _Seen] = OrderedDict()  # kept tokens, least recently used first
        self.total = 0
        self.next = 0
        self.drop: list[int] = []
        self.reset = False

    def token(self, t: torch.Tensor, fresh: dict[int, torch.Tensor], used: set[int]) -> int | None:
        """The number ``t`` goes by in this message (``fresh`` gets it when the worker is to keep
        it now), or ``None``: pickled in the message, its first sighting."""
        seen = self.seen.get(id(t))
        if seen is not None and seen.stamp.holds(t):
            if seen.token is None:
                seen.token, self.next = self.next, self.next + 1
                fresh[seen.token] = t
                self.total += seen.nbytes
            self.order[seen.token] = seen
            self.order.move_to_end(seen.token)
            used.add(seen.token)
            return seen.token
        if seen is not None:
            self._forget(seen)
            del self.seen[id(t)]
        key = id(t)
        stamp = Stamp.of(t, weakly(self._gone, key))  # held weakly: no cycle with its own stamps
        if stamp is not None:
            self.seen[key] = _Seen(stamp, t.untyped_storage().nbytes())
        return None

    def _forget(self, seen: _Seen) -> None:
        if seen.token is not None and self.order.pop(seen.token, None) is not None:
            self.drop.append(seen.token)
            self.total -= seen.nbytes
        seen.token = None

    def _gone(self, key: int) -> None:
        """The harness's tensor is gone: so is the worker's copy, at the next message."""
        seen = self.seen.get(key)
        if seen is not None and seen.stamp.ref() is None:
            self._forget(seen)
            del self.seen[key]

    def settle(self, used: set[int]) -> tuple[bool, list[int]]:
        """``(reset, drop)`` for the next envelope: the least recently used kept tensors that this
        message does not name, dropped until the rest fit :data:`KEEP_MAX_BYTES`."""
        for token, seen in list(self.order.items()):
            if self.total <= KEEP_MAX_BYTES:
                break
            if token not in used:
                self._forget(seen)
        reset, drop = self.reset, self.drop
        self.reset, self.drop = False, []
        return reset, drop

    def clear(self) -> None:
        """Forget everything; the worker is told to, at the next message (after a failed request,
        whose keeping may not have happened)."""
        self.seen.clear()
        self.order.clear()
        self.total, self.drop, self.reset = 0, [], True


class _Sender(pickle.Pickler):
    """Pickles a request with its large tensors named by :class:`_Kept` tokens where it can."""

    def __init__(self, file: io.BytesIO, kept: _Kept, fresh: dict[int, torch.Tensor], used: set[int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.kept, self.fresh, self.used = kept, fresh, used

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is not torch.Tensor or obj.is_meta or obj.untyped_storage().nbytes() < KEEP_MIN_BYTES:
            return None
        return self.kept.token(obj, self.fresh, self.used)


class _Receiver(pickle.Unpickler):
    """Unpickles a request, each token replaced by the tensor the worker keeps under it."""

    def __init__(self, file: io.BytesIO, store: dict[int, torch.Tensor]) -> None:
        super().__init__(file)
        self.store = store

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if pid not in self.store:
            raise PluginError(f"the plugin process does not hold the input it was to keep as #{pid}")
        return self.store[pid]


def _envelope(msg: dict[str, Any], kept: _Kept) -> bytes:
    """The frame of ``msg`` for the worker: the tensors to keep from now on, the ones to drop,
    and the request itself with every kept tensor named by its token."""
    buf, fresh, used = io.BytesIO(), {}, set()
    _Sender(buf, kept, fresh, used).dump(msg)
    reset, drop = kept.settle(used)
    envelope = {"ep": msg.get("ep"), "reset": reset, "drop": drop, "keep": fresh, "msg": buf.getvalue()}
    return pickle.dumps(envelope, protocol=pickle.HIGHEST_PROTOCOL)


# --- the worker ----------------------------------------------------------------------------


def _json_param(value: Any) -> Any:
    """A parameter as the report writes it: JSON scalars as they are, anything else as text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)


def describe(impl: Any, where: str) -> dict[str, Any]:
    """What the harness needs to know of one registered object (a plain dict of JSON values)."""
    if not isinstance(impl, Implementation):
        return {"invalid": f"{where} is a {type(impl).__name__}, not a k3verify Implementation"}
    return {
        "module": str(impl.module), "implementation": str(impl.implementation), "form": str(impl.form),
        "dtype": str(impl.dtype), "params": {str(k): _json_param(v) for k, v in dict(impl.params).items()},
        "rule": str(impl.rule), "cases": [str(c) for c in impl.cases], "baseline": str(impl.baseline),
        "in_map": bool(impl.in_map), "reason": impl.unavailable(), "peer": _peer(impl.peer),
        **{f"has_{m}": getattr(impl, m) is not None for m in ("predict", "explain", "map_points")},
    }


def _peer(peer: Any) -> dict[str, Any] | None:
    """A registered :class:`Peer` as plain values (``None`` for none or anything else)."""
    if not isinstance(peer, Peer):
        return None
    return {"implementation": str(peer.implementation), "form": str(peer.form),
            "params": {str(k): _json_param(v) for k, v in dict(peer.params).items()}}


class Worker:
    """The worker's side: loads entry points on demand and answers requests."""

    def __init__(self) -> None:
        self.loaded: dict[int, list[Any]] = {}
        self.kept: dict[Any, dict[int, torch.Tensor]] = {}  # per entry point: what the harness named

    def load(self, k: int, spec: tuple[str, str]) -> list[Any]:
        if k not in self.loaded:
            name, value = spec
            made = importlib.metadata.EntryPoint(name=name, value=value, group=PLUGIN_GROUP).load()()
            self.loaded[k] = [made] if isinstance(made, Implementation) else list(made)
        return self.loaded[k]

    def answer(self, msg: dict[str, Any]) -> Any:
        impls = self.load(msg["ep"], msg["spec"])
        name = msg["spec"][0]
        if msg["op"] == "describe":
            return [describe(impl, f"what plugin {name!r} returned at position {i}") for i, impl in enumerate(impls)]
        j = msg["index"]
        if j >= len(impls) or describe(impls[j], "") != msg["expect"]:
            raise PluginError(f"plugin {name!r} registered other implementations when loaded again")
        return self.call(impls[j], msg["method"], msg["arg"], tuple(msg.get("outputs", ())))

    @staticmethod
    def call(impl: Implementation, method: str, arg: Any, outputs: tuple[str, ...] = ()) -> Any:
        if method == "run":
            # The harness names the module's outputs: the worker never loads the registry.
            out = as_outputs(run_isolated(impl, arg), outputs, impl.label)
            return {n: _plain_tensor(t, f"{impl.label} output {n!r}") for n, t in out.items()}
        # Its own copy of the case, as run_isolated gives run: the kept inputs serve later calls.
        own = sealed(arg) if isinstance(arg, Case) else arg
        if method == "predict":
            p = impl.predict(own)
            return {"finite": bool(p.finite), "explanation": str(p.explanation)}
        if method == "explain":
            return [str(line) for line in impl.explain(own)]
        if method == "map_points":
            return bool(impl.map_points(own))
        if method == "time":
            from . import timing

            given = case_for(impl, arg)
            return timing.measure(lambda: impl.run(given))
        raise PluginError(f"unknown request {method!r}")

    def unpack(self, frame: bytes) -> dict[str, Any]:
        """The request in ``frame``, after keeping and dropping what its envelope says (per entry
        point: one plugin never receives another's kept tensors)."""
        envelope = pickle.loads(frame)
        store = self.kept.setdefault(envelope["ep"], {})
        if envelope["reset"]:
            store.clear()
        for token in envelope["drop"]:
            store.pop(token, None)
        store.update(envelope["keep"])
        return _Receiver(io.BytesIO(envelope["msg"]), store).load()

    def serve(self, rfd: int, wfd: int) -> None:
        while True:
            frame = _read_frame(rfd)
            if frame is None:
                return
            before = torch_state()
            try:
                reply = {"ok": True, "value": self.answer(self.unpack(frame))}
            except BaseException as exc:  # sys.exit and the like are answers too
                reply = {"ok": False, "error": _error_text(exc)}
            changed = restore(before)
            if changed and reply["ok"]:
                reply = {"ok": False, "error": "changed process-wide torch settings, which change every later "
                         f"result (restored): {'; '.join(changed)}"}
            _write_frame(wfd, _document(reply))


def _plain_tensor(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.device.type == "meta":
        raise TypeError(f"{what} is a meta tensor (no data)")
    return t.detach().to("cpu").contiguous().clone()


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {os.path.basename(where[0].filename)}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _worker_main(rfd: int, wfd: int) -> None:
    # What plugins print must not be mistaken for answers; both streams go to the forwarded pipe.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _write_frame(wfd, _document({"ok": True, "value": "ready"}))
    Worker().serve(rfd, wfd)


# --- the harness's side -----------------------------------------------------------------------


class Host:
    """The harness's handle on the worker: starts it when needed, sends requests with a timeout,
    and starts a new one after a request killed it."""

    def __init__(self, specs: list[tuple[str, str]]):
        self.specs = specs
        self.proc: zygote.Child | None = None
        self.forwarder: threading.Thread | None = None
        self.to_worker = self.from_worker = -1
        self.kept: dict[Any, _Kept] = {}

    def _start(self) -> None:
        """A fresh worker, ready for requests (forked from the zygote, :mod:`.zygote`; its
        start-up does not count against a request's timeout)."""
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        try:
            self.proc = zygote.fork_worker(f"{__name__}:_worker_main", to_r, from_w, STARTUP_TIMEOUT_S)
        except zygote.StartError as exc:
            for fd in (to_w, from_r):
                os.close(fd)
            raise PluginError(str(exc)) from None
        finally:
            os.close(to_r)
            os.close(from_w)
        self.to_worker, self.from_worker = to_w, from_r
        self.kept = {}  # a new worker keeps nothing yet
        self.forwarder = threading.Thread(target=_forward, args=(self.proc.stdout,), daemon=True)
        self.forwarder.start()
        try:
            ready = _read_frame(self.from_worker, time.monotonic() + STARTUP_TIMEOUT_S)
        except TimeoutError:
            ready = None
        if ready is None:
            self.stop()
            raise PluginError(f"the plugin process did not start within {STARTUP_TIMEOUT_S:g} s")

    def stop(self, *, grace_s: float = 0.0) -> None:
        """End the worker: it may finish within ``grace_s`` seconds once its requests end, then
        its process group is killed; what it printed is shown before this returns."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            os.close(self.to_worker)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.proc.pid, signal.SIGKILL)  # killed before its own session began
        self.proc.wait()
        if self.forwarder is not None:
            self.forwarder.join(5.0)
        with contextlib.suppress(OSError):
            os.close(self.from_worker)
        self.proc = self.forwarder = None

    def request(self, msg: dict[str, Any], what: str) -> Any:
        """The worker's answer to ``msg``; :class:`PluginError` naming ``what`` when there is none."""
        if self.proc is None:
            _make_room(self)
            self._start()
        if self in _HOSTS:
            _HOSTS.remove(self)
        _HOSTS.append(self)  # the most recently used last
        limit = timeout()
        kept = self.kept.setdefault(msg.get("ep"), _Kept())
        try:
            _write_frame(self.to_worker, _envelope(msg, kept))
            frame = _read_frame(self.from_worker, time.monotonic() + limit)
        except TimeoutError:
            self.stop()
            raise PluginError(f"{what} did not finish within {limit:g} s (--timeout); its process was stopped") \
                from None
        except (BrokenPipeError, PluginError):
            frame = None
        if frame is None:
            proc = self.proc
            self.stop(grace_s=5.0)
            raise PluginError(f"the plugin process ended (exit status {proc.returncode if proc else None}) "
                              f"during {what}")
        try:
            reply = torch.load(io.BytesIO(frame), weights_only=True)
        except Exception as exc:
            self.stop()
            raise PluginError(f"the plugin process answered {what} with something that is not a result "
                              f"({type(exc).__name__})") from None
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            self.stop()
            raise PluginError(f"the plugin process answered {what} with something that is not a result")
        if not reply["ok"]:
            kept.clear()
            raise PluginError(f"{what}: {str(reply.get('error'))[:2000]}")
        return reply.get("value")


# The longest line of a plugin's output shown (bytes); the rest of a longer line is left out, and
# never held in memory whole.
MAX_LINE_BYTES = 4096


def _forward(stream: Any) -> None:
    cut = False  # within a line already shown cut
    for piece in iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""):
        whole = piece.endswith(b"\n")
        if not cut:
            text = terminal_text(piece[:MAX_LINE_BYTES].decode("utf-8", "replace").rstrip("\n"))
            if len(piece) > MAX_LINE_BYTES:
                text += f" [line cut at {MAX_LINE_BYTES} bytes]"
            try:
                sys.stderr.write(f"plugin: {text}\n")
            except (OSError, ValueError):  # stderr closed: nothing more to show
                return
        cut = not whole


# One worker per plugin distribution: code of one package never shares a process with another's,
# so a plugin that patches what runs around it (the worker's own checks, torch, a neighbour's
# functions) reaches its own rows only.
_HOSTS: list[Host] = []


# Plugin processes alive at once: each holds its own torch (hundreds of MB); past this many the
# least recently used ends, and its next request starts it again (loading its plugin again, as
# after a crash).
MAX_WORKERS = 4


def _make_room(starting: Host) -> None:
    live = [h for h in _HOSTS if h.proc is not None and h is not starting]
    for host in live[:max(0, len(live) - MAX_WORKERS + 1)]:
        host.stop(grace_s=5.0)


def stop() -> None:
    """End every plugin process, if any (the next request to one starts a new one)."""
    while _HOSTS:
        _HOSTS.pop().stop(grace_s=5.0)


atexit.register(stop)


def load(entry_points: list[importlib.metadata.EntryPoint], outputs_of: Callable[[str], tuple[str, ...] | None],
         source_of: Callable[[importlib.metadata.EntryPoint], str],
         placeholder: Callable[..., Implementation]) -> list[Implementation]:
    """Proxies of every implementation the ``entry_points`` register, loaded in a worker per
    distribution (``source_of`` names it);
    ``placeholder(name, source, reason)`` stands in for whatever cannot be used (a plugin that
    fails, exits or hangs while loading, an object that is not an Implementation, a description
    the harness cannot use). ``outputs_of(module)`` names a registered module's outputs (``None``
    for a module that is not registered: its proxy is unavailable)."""
    stop()
    groups: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in entry_points:
        groups.setdefault(source_of(ep), []).append(ep)
    out: list[Implementation] = []
    for dist, eps in groups.items():
        host = Host([(ep.name, ep.value) for ep in eps])
        _HOSTS.append(host)
        out += _load_group(host, eps, f"{dist} (plugin)", outputs_of, placeholder)
    return out


def _load_group(host: Host, entry_points: list[importlib.metadata.EntryPoint], source: str,
                outputs_of: Callable[[str], tuple[str, ...] | None],
                placeholder: Callable[..., Implementation]) -> list[Implementation]:
    """:func:`load` for the entry points of one distribution, all served by ``host``."""
    specs = host.specs
    out: list[Implementation] = []
    for k, ep in enumerate(entry_points):
        try:
            described = host.request({"op": "describe", "ep": k, "spec": specs[k]}, f"loading plugin {ep.name!r}")
        except PluginError as exc:
            out.append(placeholder(ep.name, source, f"plugin {ep.name!r} ({ep.value}) failed: {exc}"))
            continue
        for j, d in enumerate(described if isinstance(described, list) else [None]):
            problem = _invalid(d)
            if problem:
                out.append(placeholder(ep.name, source, f"plugin {ep.name!r} ({ep.value}): {problem}"))
                continue
            out.append(_proxy(host, k, j, d, source, outputs_of(d["module"])))
    return out


def _invalid(d: Any) -> str | None:
    """Why a description cannot become a proxy, or ``None``."""
    if not isinstance(d, dict):
        return "the plugin process described it as nothing usable"
    if "invalid" in d:
        return str(d["invalid"])
    texts = ("module", "implementation", "form", "dtype", "baseline")
    if not all(isinstance(d.get(k), str) for k in texts) or not isinstance(d.get("params"), dict) \
            or not isinstance(d.get("cases"), list) or not all(isinstance(c, str) for c in d["cases"]):
        return "its description lacks names of the right types"
    if d.get("rule") not in RULES:
        return f"unknown rule {str(d.get('rule'))[:40]!r}; choose one of {RULES}"
    peer = d.get("peer")
    if peer is not None and not (isinstance(peer, dict) and set(peer) == {"implementation", "form", "params"}
                                 and isinstance(peer["implementation"], str) and isinstance(peer["form"], str)
                                 and isinstance(peer["params"], dict)):
        return "its peer is not an implementation name, a form and parameters"
    from ..numerics import resolve_dtype

    try:
        resolve_dtype(d["dtype"])
    except (KeyError, ValueError, TypeError):
        return f"unknown dtype {d['dtype'][:40]!r}"
    return None


def _proxy(host: Host, k: int, j: int, d: dict[str, Any], source: str,
           output_names: tuple[str, ...] | None) -> Implementation:
    """An Implementation whose calls are requests to the worker; ``output_names``: its module's output
    names (``None``: an unregistered module)."""
    label = f"{d['module']}/{d['implementation']}:{d['form']}[{d['dtype']}]"

    def request(method: str) -> Callable[[Any], Any]:
        def send(arg: Any) -> Any:
            if isinstance(arg, Case):  # copies of what the implementation may see; never the cache
                arg = Case(arg.name, arg.inputs, arg.params)
            return host.request({"op": "call", "ep": k, "spec": host.specs[k], "index": j, "expect": d,
                                 "method": method, "arg": arg, "outputs": output_names or ()}, f"{method} of {label}")

        return send

    run = request("run")

    def outputs(case: Case) -> Outputs:
        value = run(case)
        if not isinstance(value, dict):
            raise PluginError(f"{label} returned no named outputs")
        return value

    predict_raw = request("predict")

    def predict(case: Case) -> Prediction:
        p = predict_raw(case)
        if not isinstance(p, dict) or not isinstance(p.get("finite"), bool):
            raise PluginError(f"predict of {label} returned no prediction")
        return Prediction(p["finite"], str(p.get("explanation", "")), by_plugin=True)

    reason = d.get("reason")
    if output_names is None:
        reason = f"names module {d['module']!r}, which is not registered"
    return Implementation(
        module=d["module"], implementation=d["implementation"], form=d["form"], dtype=d["dtype"],
        params=d["params"], rule=d.get("rule", BASELINE_RULE), run=outputs,
        predict=predict if d.get("has_predict") else None,
        explain=request("explain") if d.get("has_explain") else None,
        is_available=lambda r=reason: (r is None, str(r or "")),
        cases=tuple(d["cases"]) or ("default",), baseline=d["baseline"], source=source,
        in_map=bool(d.get("in_map")), map_points=request("map_points") if d.get("has_map_points") else None,
        peer=Peer(**d["peer"]) if d.get("peer") else None, time=request("time"),
    )

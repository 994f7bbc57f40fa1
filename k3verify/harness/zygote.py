"""Plugin processes forked from one that imported torch once.

A plugin worker started as a fresh interpreter spends 1.7 s importing torch, again for every
plugin package and after every crash, hang or eviction. The *zygote* is one process, started on
the first request, that imports the worker's code (a ``module:function`` the harness names,
torch with it) and then only forks: each worker is a copy of it, made in a few milliseconds,
that calls that function with its request and answer pipes.

What a worker receives is what a fresh process received: the harness's current ``os.environ``,
``sys.path`` and working directory (not those of the moment the zygote started), a session of
its own (a timeout kills its process group), standard input from ``/dev/null``, and standard
output and error on the harness's pipe. Its random sequences are its own: Python's ``random``
re-seeds itself in a forked child, and numpy's global generator is not loaded in the zygote, so
each worker seeds its own (``properties/test_zygote.py`` holds both). The zygote never holds
anything of the harness's beyond those settings: no case, oracle or result ever reaches it, so a
worker forked from it holds none either. The zygote lives in a session of its own and ends when the harness's socket
closes (the harness exited, however it ended).

Protocol on the socket pair (harness -> zygote): an 8-byte little-endian length carrying four
descriptors (the worker's request pipe, its answer pipe, its output pipe and a status pipe),
then a pickle of the settings; the zygote answers the worker's pid (8 bytes, signed). When the
worker ends, the zygote writes its raw wait status (4 bytes) to the status pipe and closes it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

_LEN = struct.Struct("<q")
_STATUS = struct.Struct("<i")
_FDS = 4


class StartError(RuntimeError):
    """The zygote could not make a worker; the message says why."""


class Child:
    """A forked worker, seen from the harness as much like :class:`subprocess.Popen` as it uses:
    ``pid``, ``stdout`` (the worker's output, both streams), ``returncode`` and :meth:`wait`."""

    def __init__(self, pid: int, stdout: BinaryIO, status_fd: int):
        self.pid, self.stdout, self._status_fd = pid, stdout, status_fd
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (minus the signal's number for a worker a signal ended; ``None`` if the
        zygote ended before it could say); :class:`subprocess.TimeoutExpired` after ``timeout``."""
        if self._status_fd < 0:
            return self.returncode
        if not select.select([self._status_fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"plugin worker {self.pid}", timeout or 0.0)
        raw = b""
        while len(raw) < _STATUS.size:
            chunk = os.read(self._status_fd, _STATUS.size - len(raw))
            if not chunk:
                break
            raw += chunk
        os.close(self._status_fd)
        self._status_fd = -1
        if len(raw) == _STATUS.size:
            self.returncode = os.waitstatus_to_exitcode(_STATUS.unpack(raw)[0])
        return self.returncode


class _Zygote:
    """The harness's handle on the zygote process (one per harness process)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.last_exit: int | None = None  # the exit status of the zygote that ended last
        self.lock = threading.Lock()

    def _start(self, startup_timeout_s: float) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        with theirs:
            # A session of its own: a Ctrl-C at the terminal reaches the harness, not the zygote,
            # which ends when the harness's end of the socket closes. It prints nothing, and does
            # not hold the harness's standard output open (a reader of it waits for its end).
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), self.target],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, env=env, start_new_session=True)
        ours.settimeout(startup_timeout_s)
        try:
            ready: bytes | None = ours.recv(1)
        except TimeoutError:
            ready = None
        ours.settimeout(None)
        if ready != b"r":
            ours.close()
            self._end()
            if ready is None:
                raise StartError(f"the plugin processes' zygote did not start within {startup_timeout_s:g} s")
            code = self.last_exit
            raise StartError(f"the plugin processes' zygote for {self.target!r} ended while starting (exit status "
                             f"{code}; its error, if any, is above)")
        self.sock = ours

    def _end(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)
            if self.proc.returncode is None:
                self.proc.kill()
                self.proc.wait()
            self.last_exit = self.proc.returncode
            self.proc = None

    def _ask(self, fds: list[int], settings: bytes) -> int:
        """The pid of a worker forked with ``fds``; ``OSError`` when the zygote is gone."""
        assert self.sock is not None
        socket.send_fds(self.sock, [_LEN.pack(len(settings))], fds)
        self.sock.sendall(settings)
        raw = b""
        while len(raw) < _LEN.size:
            chunk = self.sock.recv(_LEN.size - len(raw))
            if not chunk:
                raise ConnectionResetError("the zygote ended")
            raw += chunk
        return _LEN.unpack(raw)[0]

    def fork(self, to_worker: int, from_worker: int, startup_timeout_s: float) -> Child:
        """A worker reading requests from ``to_worker`` and answering on ``from_worker`` (the
        harness's copies of both stay open: close them after this returns)."""
        out_r, out_w = os.pipe()
        status_r, status_w = os.pipe()
        settings = pickle.dumps({"env": dict(os.environ), "path": list(sys.path), "cwd": os.getcwd()})
        try:
            with self.lock:
                pid = None
                for _attempt in range(2):  # a zygote that died (killed, out of memory) is started again
                    if self.sock is None:
                        self._start(startup_timeout_s)
                    try:
                        pid = self._ask([to_worker, from_worker, out_w, status_w], settings)
                        break
                    except OSError:
                        self._end()
                if pid is None:
                    raise StartError("the plugin processes' zygote ended twice while forking a worker")
                if pid < 0:
                    raise StartError(f"the zygote could not fork a worker: {os.strerror(-pid)}")
        except BaseException:
            os.close(out_r)
            os.close(status_r)
            raise
        finally:
            os.close(out_w)
            os.close(status_w)
        return Child(pid, os.fdopen(out_r, "rb"), status_r)

    def stop(self) -> None:
        with self.lock:
            self._end()


_ZYGOTES: dict[str, _Zygote] = {}


def fork_worker(target: str, to_worker: int, from_worker: int, startup_timeout_s: float) -> Child:
    """A worker running ``target`` (``"module:function"``, called with the request and answer
    descriptors), forked from this harness's zygote for it (started on the first call)."""
    if target not in _ZYGOTES:
        _ZYGOTES[target] = _Zygote(target)
    return _ZYGOTES[target].fork(to_worker, from_worker, startup_timeout_s)


def stop() -> None:
    """End every zygote (the next :func:`fork_worker` starts one again)."""
    for zygote in _ZYGOTES.values():
        zygote.stop()


atexit.register(stop)


# --- the zygote's side -------------------------------------------------------------------------


def _recv_request(sock: socket.socket) -> tuple[list[int], dict[str, Any]] | None:
    """The next request's descriptors and settings; ``None`` once the harness is gone."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, _FDS)
    if not head:
        return None
    while len(head) < _LEN.size:
        more = sock.recv(_LEN.size - len(head))
        if not more:
            return None
        head += more
    (length,) = _LEN.unpack(head)
    payload = bytearray()
    while len(payload) < length:
        more = sock.recv(min(1 << 20, length - len(payload)))
        if not more:
            return None
        payload += more
    return list(fds), pickle.loads(bytes(payload))


def _become_worker(worker: Callable[[int, int], None], fds: list[int], settings: dict[str, Any],
                   closing: list[int]) -> None:
    """In the forked child: the settings of a fresh process, then the worker's loop; never returns."""
    code = 1
    try:
        for fd in closing:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        to_worker, from_worker, out, _status = fds
        os.close(_status)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.chdir(settings["cwd"])
        os.environ.clear()
        os.environ.update(settings["env"])
        sys.path[:] = settings["path"]
        importlib.invalidate_caches()  # a plugin site may have been written since the zygote looked
        worker(to_worker, from_worker)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(statuses: dict[int, int]) -> None:
    """Write each ended worker's wait status to its status pipe."""
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = statuses.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, _STATUS.pack(status))
            os.close(fd)


def _serve(sock: socket.socket, worker: Callable[[int, int], None]) -> None:
    """Fork a worker per request until the harness's end of ``sock`` closes."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select through the pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    statuses: dict[int, int] = {}
    sock.sendall(b"r")
    while True:
        try:
            ready = select.select([sock, wake_r], [], [])[0]
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(statuses)
        if sock not in ready:
            continue
        request = _recv_request(sock)
        if request is None:
            break
        fds, settings = request
        if len(fds) != _FDS:
            for fd in fds:
                os.close(fd)
            sock.sendall(_LEN.pack(-22))  # EINVAL
            continue
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            sock.sendall(_LEN.pack(-(exc.errno or 12)))
            continue
        if pid == 0:
            _become_worker(worker, fds, settings, [sock.fileno(), wake_r, wake_w, *statuses.values()])
        for fd in fds[:3]:
            os.close(fd)
        statuses[pid] = fds[3]
        sock.sendall(_LEN.pack(pid))
    # The harness is gone: its workers see their request pipes close and end on their own; wait
    # a little for their statuses, then leave (nothing reads them any more).
    deadline = time.monotonic() + 1.0
    while statuses and time.monotonic() < deadline:
        _reap(statuses)
        time.sleep(0.02)


def _main(fd: int, target: str) -> None:
    # The worker's code, and torch with it, loads here once; every fork starts with it loaded.
    module, _, name = target.partition(":")
    _serve(socket.socket(fileno=fd), getattr(importlib.import_module(module), name))


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2])

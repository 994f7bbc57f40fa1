"""Safe file handling for everything k3verify reads from or writes to disk.

A verification harness runs in CI on files that arrive in pull requests, so:

- **Reads are confined and bounded.** :func:`read_confined` takes a path relative to a root
  folder and refuses absolute paths, ``..``, symlinks anywhere on the way, anything but a
  regular file, and files larger than the caller's bound (checked before reading).
  :func:`read_json` parses a bounded file and turns every failure into a :class:`UsageError`
  naming the path.
- **Writes are atomic, as a set.** :func:`staged_folder` builds the new version of a folder in
  a staging folder beside it (the entries the caller does not rewrite are carried over as hard
  links), flushes it to disk, and swaps it in with one ``renameat2(RENAME_EXCHANGE)``: a reader,
  a kill at any point (SIGINT, SIGKILL) or a full disk leaves either the old folder or the new
  one, never a mix. Leftover staging folders of a killed writer are removed by the next writer.
- **One writer per folder.** The swap holds an exclusive lock on ``.<name>.k3verify-lock``
  beside the folder; a second writer is refused at once with a message naming the folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

MAX_JSON_BYTES = 64 * 1024 * 1024
_STAGING = ".k3verify-staging-"
_LOCK = ".k3verify-lock"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class UsageError(Exception):
    """A bad argument, path or input file: the command prints this one line and exits 2."""


# --- reading ------------------------------------------------------------------------------


def check_relative(rel: object, what: str = "path") -> PurePosixPath:
    """``rel`` as a relative POSIX path of plain names (letters, digits, ``_ . -``; no ``..``,
    no leading dot, no absolute path, no backslash); ``UsageError`` naming it otherwise."""
    if not isinstance(rel, str) or not rel:
        raise UsageError(f"{what} {rel!r} is not a relative path")
    path = PurePosixPath(rel)
    if path.is_absolute() or "\\" in rel or any(not _SAFE_PART.match(p) for p in path.parts):
        raise UsageError(f"{what} {rel!r} is not a plain relative path inside its folder")
    return path


def read_confined(root: Path, rel: str, *, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of ``root/rel``, refusing symlinks on the way, non-regular files and files
    over ``max_bytes`` (checked before reading). ``UsageError`` names the path."""
    parts = check_relative(rel, what).parts
    path = root
    for i, part in enumerate(parts):
        path = path / part
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise UsageError(f"{path}: {what} is missing") from None
        except OSError as exc:
            raise UsageError(f"{path}: {what} cannot be read: {exc.strerror}") from None
        if stat.S_ISLNK(info.st_mode):
            raise UsageError(f"{path}: {what} is a symlink; k3verify reads only regular files inside {root}")
        last = i == len(parts) - 1
        if last and not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path}: {what} is not a regular file")
        if not last and not stat.S_ISDIR(info.st_mode):
            raise UsageError(f"{path}: {what}: {path} is not a folder")
    if info.st_size > max_bytes:
        raise UsageError(f"{path}: {what} has {info.st_size} bytes, more than the {max_bytes} allowed")
    return _read_bounded(path, max_bytes, what)


def _read_bounded(path: Path, max_bytes: int, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise UsageError(f"{path}: {what} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UsageError(f"{path}: {what} is larger than the {max_bytes} bytes allowed")
    return data


def read_json(path: Path, *, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A bounded JSON document; ``UsageError`` naming ``path`` when it is missing, too large, not
    UTF-8, malformed or not strict JSON (see :func:`parse_json`)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise UsageError(f"{path}: {what} not found") from None
    except OSError as exc:
        raise UsageError(f"{path}: {what} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{path}: {what} is not a regular file")
    if info.st_size > max_bytes:
        raise UsageError(f"{path}: {what} has {info.st_size} bytes, more than the {max_bytes} allowed")
    return parse_json(_read_bounded(path, max_bytes, what), path, what)


class _Refused:
    """Stands in the parsed document where strict JSON was broken, so the problem can be named
    with its place in the document once parsing is done (the parser's hooks do not know it)."""

    def __init__(self, problem: str):
        self.problem = problem


def _beyond_double(text: str) -> _Refused:
    shown = text if len(text) <= 40 else text[:40] + "..."
    return _Refused(f"number {shown} is beyond the range of a double")


def _finite_float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _beyond_double(text)


def _double_range_int(text: str) -> int | _Refused:
    # Readers take numbers as doubles (err / limit, thresholds); an integer no double holds
    # would overflow there, so it is refused like a float that overflows.
    value = int(text)
    return value if abs(value) <= sys.float_info.max else _beyond_double(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Refused:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            return _Refused(f"key {key[:40]!r} appears twice")
        out[key] = value
    return out


def _first_refused(doc: Any) -> tuple[str, _Refused] | None:
    """``(JSON pointer, marker)`` of the first :class:`_Refused` in ``doc`` (document order), if any."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, _Refused):
            return where or "/", value
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack += reversed([(f"{where}/{str(k).replace('~', '~0').replace('/', '~1')}", v) for k, v in items])
    return None


def parse_json(data: bytes, path: Path | str, what: str) -> Any:
    """``data`` parsed as strict JSON; ``UsageError`` naming ``path`` (and, for the last three,
    where in the document as a JSON pointer) for text that is not UTF-8 or not JSON, NaN or
    Infinity, a number beyond the range of a double (``1e999``, which Python would read as
    inf), and a key that appears twice in one object (parsers disagree on which one wins)."""

    def reject(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=reject, parse_float=_finite_float,
                         parse_int=_double_range_int, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError:
        raise UsageError(f"{path}: {what} is not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{path}: {what} is not valid JSON: {str(exc)[:200]}") from None
    refused = _first_refused(doc)
    if refused is not None:
        where, marker = refused
        raise UsageError(f"{path}: {what} is not strict JSON: at {where[:200]!r}: {marker.problem}")
    return doc


def require_keys(doc: Any, keys: dict[str, type | tuple[type, ...]], path: Path | str, what: str) -> dict[str, Any]:
    """``doc`` if it is an object holding every key of ``keys`` with a value of its type."""
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: {what} is a JSON {type(doc).__name__}, not an object")
    for key, kind in keys.items():
        if key not in doc:
            raise UsageError(f"{path}: {what} has no {key!r}")
        if not isinstance(doc[key], kind) or (kind is int and isinstance(doc[key], bool)):
            raise UsageError(f"{path}: {what}'s {key!r} is a {type(doc[key]).__name__}")
    return doc


def json_safe(value: Any) -> Any:
    """Replace inf/NaN floats by ``None`` recursively (JSON has no non-finite numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# --- writing ------------------------------------------------------------------------------


def check_output_folder(path: Path, what: str = "output folder") -> None:
    """Refuse, before any long computation, a folder k3verify could not write or swap: a file,
    a path below a file, an unwritable place, or a folder holding the working directory or a
    git checkout. ``UsageError`` names the path."""
    target = Path(os.path.abspath(path))
    if os.path.lexists(target):
        if target.is_symlink():
            raise UsageError(f"{path}: {what} is a symlink; give the folder itself")
        if not target.is_dir():
            raise UsageError(f"{path}: {what} is a file, not a folder")
        cwd = Path.cwd().resolve()
        if cwd == target.resolve() or target.resolve() in cwd.parents:
            raise UsageError(f"{path}: {what} holds the working directory; k3verify replaces the folder it writes")
        if (target / ".git").exists():
            raise UsageError(f"{path}: {what} is a git checkout; k3verify replaces the folder it writes")
    existing = target.parent
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{path}: cannot create {what}: {existing} is a file")
    try:
        existing_probe = tempfile.NamedTemporaryFile(dir=existing, prefix=".k3verify-probe-")
    except OSError as exc:
        raise UsageError(f"{path}: cannot write {what} under {existing}: {exc.strerror}") from None
    existing_probe.close()


@contextlib.contextmanager
def _lock(target: Path) -> Iterator[None]:
    lock_path = target.parent / f".{target.name}{_LOCK}"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise UsageError(f"{target}: cannot lock the folder ({lock_path}: {exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{target}: another k3verify process is writing this folder; wait for it") from None
        yield
    finally:
        os.close(fd)


def _remove_leftovers(target: Path) -> None:
    """Staging folders of writers that were killed (we hold the lock, so none is live)."""
    for stale in target.parent.glob(f".{target.name}{_STAGING}*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry(entry: os.DirEntry, dst: Path) -> None:
    if entry.is_symlink():
        os.symlink(os.readlink(entry.path), dst)
    elif entry.is_dir(follow_symlinks=False):
        shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(entry.path, str(dst))


def _fsync_tree(root: Path) -> None:
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a folder; the data is synced already
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where the system cannot."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _swap(stage: Path, target: Path) -> None:
    """Make ``stage`` the folder at ``target``; afterwards ``stage`` holds the old folder (if any)."""
    if not os.path.lexists(target):
        os.rename(stage, target)
    elif not _exchange(stage, target):
        # No atomic exchange here: the folder is absent between these two renames.
        old = stage.with_name(stage.name + "-old")
        os.rename(target, old)
        os.rename(stage, target)
        os.rename(old, stage)
    _fsync_dir(target.parent)


@contextlib.contextmanager
def staged_folder(target: Path, *, carry: Callable[[str], bool]) -> Iterator[Path]:
    """Yield a staging folder in which the caller writes the new version of ``target``; swap it
    in when the block ends without an exception (see the module docstring).

    ``carry(name)`` says which top-level entries of the current ``target`` stay in the new
    version (carried as hard links, so nothing is copied); the others are dropped unless the
    caller writes them again. An exception or interrupt inside the block leaves ``target`` as
    it was.
    """
    check_output_folder(target)
    target = Path(os.path.abspath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target):
        _remove_leftovers(target)
        stage = Path(tempfile.mkdtemp(prefix=f".{target.name}{_STAGING}", dir=target.parent))
        try:
            mode = target.stat().st_mode & 0o7777 if target.is_dir() else 0o777 & ~_umask()
            os.chmod(stage, mode)
            if target.is_dir():
                with os.scandir(target) as entries:
                    for entry in entries:
                        if carry(entry.name):
                            _carry(entry, stage / entry.name)
            yield stage
            _fsync_tree(stage)
            _swap(stage, target)
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

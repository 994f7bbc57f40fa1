"""Safe file handling for everything k3verify reads from or writes to disk.

A verification harness runs in CI on files that arrive in pull requests, so:

- **Reads are confined and bounded.** :func:`read_confined` takes a path relative to a root
  folder and refuses absolute paths, ``..``, symlinks anywhere on the way, anything but a
  regular file, and files larger than the caller's bound (checked before reading).
  :func:`read_json` parses a bounded file and turns every failure into a :class:`UsageError`
  naming the path.
- **Writes are atomic, as a set.** :func:`staged_folder` builds the new version of a folder in
  a staging folder beside it (the entries the caller does not rewrite are carried over as hard
  links), flushes it to disk, checks that it is still the folder it made and holds what was
  written, and swaps it in with one ``renameat2(RENAME_EXCHANGE)``: a reader, a kill at any
  point (SIGINT, SIGKILL) or a full disk leaves either the old folder or the new one, never a
  mix. Entries other programs created or replaced meanwhile among the carried ones are kept.
  Leftover staging folders of a killed writer are removed by the next writer of the same
  folder, and only those (the folder's name is matched literally).
- **One writer per folder.** A writer holds an exclusive lock on ``.<name>.k3verify-lock``
  beside the folder; a second writer is refused at once with a message naming the folder.
  Commands take it with :func:`hold_output_folder` before they compute anything and keep it to
  the end (the lock is re-entrant within a process). Every tree walk is iterative, so a folder
  of any depth is carried, flushed and removed without recursion.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import itertools
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

MAX_JSON_BYTES = 64 * 1024 * 1024
_STAGING = ".k3verify-staging-"
_STAGE_RANDOM = 8  # the random characters tempfile.mkdtemp puts after the prefix
_OLD = "-old"  # the staging folder's suffix while the fallback swap holds the old folder there
_LOCK = ".k3verify-lock"
_RENAME_NOREPLACE = 1
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


def read_confined(root: Path, rel: str, *, max_bytes: int, what: str = "file", dir_fd: int | None = None) -> bytes:
    """The bytes of ``root/rel``, refusing symlinks on the way, non-regular files and files
    over ``max_bytes`` (checked before reading). ``UsageError`` names the path.

    With ``dir_fd`` (a descriptor of the folder ``root`` named when it was opened), ``rel`` is
    read in that folder even if another folder has taken the name ``root`` since."""
    parts = check_relative(rel, what).parts
    path = root
    for i, part in enumerate(parts):
        path = path / part
        try:
            info = os.lstat(path if dir_fd is None else "/".join(parts[: i + 1]), dir_fd=dir_fd)
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
    return _read_bounded(path, max_bytes, what, opened=None if dir_fd is None else (rel, dir_fd))


def _read_bounded(path: Path, max_bytes: int, what: str, opened: tuple[str, int] | None = None) -> bytes:
    """At most ``max_bytes`` of ``path`` (or of ``opened``: a path relative to a folder descriptor)."""
    try:
        # Non-blocking, so a path swapped for a FIFO since it was checked cannot hang the open;
        # the descriptor must then still be a regular file.
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path, flags) if opened is None else os.open(opened[0], flags, dir_fd=opened[1])
    except OSError as exc:
        raise UsageError(f"{path}: {what} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path}: {what} is not a regular file")
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
        next(_REFUSALS)


# Counts every _Refused made (``next`` on a count is atomic): a parse that made none has
# nothing to look for, and a report's documents hold hundreds of thousands of values.
_REFUSALS = itertools.count()


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

    before = next(_REFUSALS)
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=reject, parse_float=_finite_float,
                         parse_int=_double_range_int, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError:
        raise UsageError(f"{path}: {what} is not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{path}: {what} is not valid JSON: {str(exc)[:200]}") from None
    refused = _first_refused(doc) if next(_REFUSALS) > before + 1 else None
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


class StagingError(OSError):
    """The new version of a folder is not what its writer wrote (its staging folder was removed
    or changed by another program): nothing was swapped in, the previous folder is kept."""


def check_output_folder(path: Path, what: str = "output folder") -> None:
    """Refuse, before any long computation, a folder k3verify could not write or swap: a file,
    a path below a file, an unwritable place, a folder holding the working directory or a git
    checkout, or a name whose staging folder would not fit the file system's name or path
    length. ``UsageError`` names the path."""
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
    _check_name_lengths(target, existing, path, what)
    try:
        existing_probe = tempfile.NamedTemporaryFile(dir=existing, prefix=".k3verify-probe-")
    except OSError as exc:
        raise UsageError(f"{path}: cannot write {what} under {existing}: {exc.strerror}") from None
    existing_probe.close()


def _check_name_lengths(target: Path, existing: Path, path: Path, what: str) -> None:
    """The longest name k3verify puts beside ``target`` (a staging folder renamed ``...-old`` by
    the fallback swap) must fit the file system's NAME_MAX, and its path PATH_MAX."""
    longest = f".{target.name}{_STAGING}{'x' * _STAGE_RANDOM}{_OLD}"
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):  # the system does not say: the write itself will tell
        return
    name_bytes, path_bytes = len(os.fsencode(longest)), len(os.fsencode(str(target.parent / longest)))
    if name_bytes > name_max:
        raise UsageError(f"{path}: {what}'s name is too long: the staging folder beside it would be named with "
                         f"{name_bytes} bytes, more than the {name_max} this file system allows")
    if path_bytes >= path_max:
        raise UsageError(f"{path}: {what}'s path is too long: the staging folder beside it would have a path of "
                         f"{path_bytes} bytes, more than the {path_max - 1} allowed")


@dataclass
class _Lock:
    """One folder lock this process holds: its file, how many blocks hold it, and whether a
    staged write of the folder is under way."""

    fd: int
    holders: int = 0
    writing: bool = False


# Locks this process holds, by the lock file's (device, inode): flock is per open file, so
# taking the lock again through a new descriptor would refuse this process itself.
_HELD: dict[tuple[int, int], _Lock] = {}
_HELD_GUARD = threading.Lock()


@contextlib.contextmanager
def folder_lock(target: Path) -> Iterator[_Lock]:
    """Hold the writer's lock of the folder ``target`` (``.<name>.k3verify-lock`` beside it,
    whose parent must exist) while the block runs. Re-entrant within this process; refused at
    once with ``UsageError`` naming the folder while another process holds it."""
    target = Path(os.path.abspath(target))
    lock_path = target.parent / f".{target.name}{_LOCK}"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise UsageError(f"{target}: cannot lock the folder ({lock_path}: {exc.strerror})") from None
    info = os.fstat(fd)
    key = (info.st_dev, info.st_ino)
    with _HELD_GUARD:
        lock = _HELD.get(key)
        if lock is not None:
            os.close(fd)
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(f"{target}: another k3verify process is writing this folder; wait for it") from None
            lock = _HELD[key] = _Lock(fd)
        lock.holders += 1
    try:
        yield lock
    finally:
        with _HELD_GUARD:
            lock.holders -= 1
            if not lock.holders:
                del _HELD[key]
                os.close(lock.fd)


@contextlib.contextmanager
def hold_output_folder(path: Path, what: str = "output folder") -> Iterator[None]:
    """Check ``path`` as :func:`check_output_folder` does and hold its writer's lock while the
    block runs, so that a command refuses a folder another process is writing before it
    computes anything, and keeps it until its own write is done (creates missing parents)."""
    check_output_folder(path, what)
    target = Path(os.path.abspath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(target):
        yield


def _remove_leftovers(target: Path) -> None:
    """Staging folders of killed writers of ``target`` (we hold its lock, so none is live).
    Only names ``.<name>.k3verify-staging-`` + mkdtemp's random part (+ ``-old``) are taken,
    the name matched literally: another folder's staging folders are never touched."""
    own = re.compile(re.escape(f".{target.name}{_STAGING}") + f"[a-z0-9_]{{{_STAGE_RANDOM}}}(?:{_OLD})?")
    with os.scandir(target.parent) as entries:
        stale = [e.path for e in entries if own.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    for path in stale:
        remove_tree(Path(path))


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything below it, at any depth (no recursion) and without
    following symlinks. What cannot be removed stays: it is a leftover the next writer retries."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
    except OSError:
        return
    folders, pending = [], [str(path)]
    while pending:
        folder = pending.pop()
        folders.append(folder)
        try:
            with os.scandir(folder) as entries:
                listed = list(entries)
        except OSError:
            continue
        for entry in listed:
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    for folder in reversed(folders):  # every folder comes after its parent in ``folders``
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _walk(root: Path) -> Iterator[tuple[str, os.DirEntry]]:
    """``(path relative to root, entry)`` of everything below ``root``, a folder before what it
    holds, at any depth (no recursion), without following symlinks. Each folder is listed
    whole before its entries are yielded."""
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(root / rel if rel else root) as entries:
            listed = sorted(entries, key=lambda e: e.name)
        for entry in listed:
            child = f"{rel}/{entry.name}" if rel else entry.name
            yield child, entry
            if entry.is_dir(follow_symlinks=False):
                pending.append(child)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry(target: Path, stage: Path, carry: Callable[[str], bool]) -> dict[str, tuple[int, int]]:
    """Carry the entries of ``target`` that ``carry`` keeps into ``stage`` (files as hard links,
    folders rebuilt, symlinks as symlinks, at any depth); return, per carried path, the inodes of
    the original and of the carried entry, so the swap can tell what others changed meanwhile."""
    carried: dict[str, tuple[int, int]] = {}
    with os.scandir(target) as entries:
        pending = [e.name for e in entries if carry(e.name)]
    while pending:
        rel = pending.pop()
        src, dst = target / rel, stage / rel
        try:
            info = os.lstat(src)
            if stat.S_ISLNK(info.st_mode):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISDIR(info.st_mode):
                os.mkdir(dst)
                os.chmod(dst, stat.S_IMODE(info.st_mode))
                with os.scandir(src) as entries:
                    pending += [f"{rel}/{e.name}" for e in entries]
            else:
                _link_or_copy(str(src), str(dst))
        except FileNotFoundError:
            # Another program removed or renamed it since the listing; whatever stands there at
            # the swap is brought over then (_keep_others_changes).
            with contextlib.suppress(OSError):
                os.rmdir(dst)  # a folder begun for it, still empty
            continue
        carried[rel] = (info.st_ino, os.lstat(dst).st_ino)
    return carried


def _inventory(root: Path) -> dict[str, tuple[int, int]]:
    """What ``root`` holds: ``{relative path: (inode, mode)}``."""
    out = {}
    for rel, entry in _walk(root):
        info = entry.stat(follow_symlinks=False)
        out[rel] = (info.st_ino, info.st_mode)
    return out


def _settle(stage: Path) -> dict[str, tuple[int, int]]:
    """Flush every file and folder of ``stage`` to disk; return its :func:`_inventory`, to be
    compared right before the swap."""
    held = _inventory(stage)
    for rel, (_, mode) in held.items():
        if stat.S_ISREG(mode):
            fd = os.open(stage / rel, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif stat.S_ISDIR(mode):
            _fsync_dir(stage / rel)
    _fsync_dir(stage)
    return held


def _check_same_stage(stage: Path, stage_fd: int) -> None:
    """``StagingError`` unless ``stage`` is still the folder made for this write: not removed,
    nor removed and made again (the open descriptor keeps its inode number from being reused)."""
    original = os.fstat(stage_fd)
    try:
        now = os.lstat(stage)
    except OSError:
        now = None
    if now is None or original.st_nlink == 0 or (now.st_dev, now.st_ino) != (original.st_dev, original.st_ino):
        raise StagingError(errno.ESTALE, "the staging folder was removed or replaced by another program before "
                           "the swap; the previous folder is kept", str(stage))


def _check_stage(stage: Path, stage_fd: int, settled: dict[str, tuple[int, int]]) -> None:
    """``StagingError`` unless ``stage`` is still the folder made for this write and holds
    exactly what was settled, which is not nothing."""
    _check_same_stage(stage, stage_fd)
    if not settled:
        raise StagingError(errno.ENODATA, "the staging folder is empty: nothing was written, so nothing is "
                           "swapped in; the previous folder is kept", str(stage))
    held = _inventory(stage)
    if held != settled:
        changed = sorted(set(held) ^ set(settled) | {r for r in held if r in settled and held[r] != settled[r]})
        raise StagingError(errno.ESTALE, f"another program changed the staging folder before the swap "
                           f"({', '.join(changed[:3])}); the previous folder is kept", str(stage))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a folder; the data is synced already
        pass
    finally:
        os.close(fd)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """``renameat2(a, b, flags)`` (Linux); False where the system cannot, ``OSError`` on failure."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where the system cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _swap(stage: Path, target: Path) -> None:
    """Make ``stage`` the folder at ``target``; afterwards ``stage`` holds the old folder (if any)."""
    if os.path.lexists(target) and not stat.S_ISDIR(os.lstat(target).st_mode):
        raise StagingError(errno.ENOTDIR, "is no longer a folder (replaced by another program); nothing was "
                           "swapped in", str(target))
    if not os.path.lexists(target):
        os.rename(stage, target)
    elif not _exchange(stage, target):
        # No atomic exchange here: the folder is absent between these two renames.
        old = stage.with_name(stage.name + _OLD)
        os.rename(target, old)
        os.rename(stage, target)
        os.rename(old, stage)
    _fsync_dir(target.parent)


def _keep_others_changes(old: Path, new: Path, carried: dict[str, tuple[int, int]],
                         carry: Callable[[str], bool]) -> None:
    """After the swap, bring into ``new`` what other programs did to the kept entries of the
    folder (now at ``old``) while the new version was built: entries they created move over and
    entries they replaced replace the carried copy. Entries the writer wrote itself win; an
    entry removed meanwhile stays in the new version (nothing is lost, the set stays whole)."""
    if not os.path.isdir(old) or os.path.islink(old):
        return
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            with os.scandir(old / rel_dir if rel_dir else old) as entries:
                listed = list(entries)
        except OSError:
            continue
        for entry in listed:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if not rel_dir and not carry(entry.name):
                continue
            ours = _inode(new / rel)
            if rel not in carried:
                if ours is None:  # created meanwhile (the writer did not write this name)
                    _move(old / rel, new / rel)
            elif entry.inode() != carried[rel][0]:
                if ours == carried[rel][1]:  # replaced meanwhile, and our copy is the carried one
                    _replace(old / rel, new / rel)
            elif entry.is_dir(follow_symlinks=False):
                pending.append(rel)


def _inode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


def _move(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists by then (the writer's entry wins)."""
    with contextlib.suppress(OSError):
        if not _renameat2(src, dst, _RENAME_NOREPLACE) and not os.path.lexists(dst):
            os.rename(src, dst)


def _replace(src: Path, dst: Path) -> None:
    """Put ``src`` at ``dst`` in place of what is there (a folder included)."""
    with contextlib.suppress(OSError):
        if os.path.isdir(dst) and not os.path.islink(dst):
            if _exchange(src, dst):
                return  # the carried copy is now at ``src`` and goes with the old folder
            remove_tree(dst)
        os.rename(src, dst)


@contextlib.contextmanager
def staged_folder(target: Path, *, carry: Callable[[str], bool]) -> Iterator[Path]:
    """Yield a staging folder in which the caller writes the new version of ``target``; swap it
    in when the block ends without an exception (see the module docstring).

    ``carry(name)`` says which top-level entries of the current ``target`` stay in the new
    version (carried as hard links, so nothing is copied); the others are dropped unless the
    caller writes them again. Entries other programs create or replace among the carried ones
    while the block runs are kept. An exception or interrupt inside the block leaves
    ``target`` as it was; so does a staging folder that another program removed or changed
    (``StagingError``), and an empty one.
    """
    check_output_folder(target)
    target = Path(os.path.abspath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(target) as lock:
        if lock.writing:
            raise UsageError(f"{target}: another k3verify process is writing this folder; wait for it")
        lock.writing = True
        try:
            _remove_leftovers(target)
            stage = Path(tempfile.mkdtemp(prefix=f".{target.name}{_STAGING}", dir=target.parent))
            stage_fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                mode = target.stat().st_mode & 0o7777 if target.is_dir() else 0o777 & ~_umask()
                os.chmod(stage, mode)
                carried = _carry(target, stage, carry) if target.is_dir() else {}
                try:
                    yield stage
                except OSError:
                    _check_same_stage(stage, stage_fd)  # the cause, when another program removed it
                    raise
                _check_same_stage(stage, stage_fd)
                settled = _settle(stage)
                _check_stage(stage, stage_fd, settled)
                _swap(stage, target)
                _keep_others_changes(stage, target, carried, carry)
            finally:
                os.close(stage_fd)
                remove_tree(stage)
        finally:
            lock.writing = False


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

"""Resume files: the finished pieces of a long command, kept until its output is written.

A partial file is JSON lines ``{"key": ..., "index": ..., "cell": {...}}``, one per finished
piece (a map's cell, a walk's job), appended and flushed as each one ends, so an interrupted
or cut-off run keeps all it finished. ``key`` hashes everything that decides the piece's result
(the code's version among it), so a rerun takes only what the same code computed for the same
question. The command line keeps them in ``<out>/.partial/<name>.jsonl``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from .files import json_safe


def partial_path(out_dir: Path, name: str) -> Path:
    """Where the finished pieces of ``name`` (a module's map, the decoder walk) are kept."""
    return out_dir / ".partial" / f"{name}.jsonl"


def remove_partial(out_dir: Path, name: str) -> None:
    """Remove ``name``'s partial file (its output is written), and the partial folder once empty."""
    path = partial_path(out_dir, name)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def piece_key(what: Mapping[str, Any]) -> str:
    """SHA-256 of ``what`` as canonical JSON: the key a piece is stored under."""
    return hashlib.sha256(json.dumps(json_safe(dict(what)), sort_keys=True, default=str).encode()).hexdigest()


def as_json(piece: Mapping[str, Any]) -> dict[str, Any]:
    """``piece`` as it reads back from JSON, so that computed and resumed pieces are alike."""
    return json.loads(json.dumps(json_safe(dict(piece)), allow_nan=False))


def read_partial(path: Path | None, keys: Mapping[str, int],
                 sound: Callable[[dict[str, Any]], bool] = lambda piece: True) -> dict[int, dict[str, Any]]:
    """The finished pieces a partial file holds for this run: index -> piece, for the lines
    whose key is one of ``keys`` (key -> index). A line cut short by an interrupted write, any
    line that is not such a record, or a piece that is not ``sound`` (a field of the wrong type:
    the file is anyone's to edit) is skipped, and computed again."""
    found: dict[int, dict[str, Any]] = {}
    if path is None or not path.is_file():
        return found
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("key") in keys and isinstance(record.get("cell"), dict) \
                    and sound(record["cell"]):
                found[keys[record["key"]]] = record["cell"]
    return found


def open_sink(path: Path | None) -> IO[str] | None:
    """``path`` opened for appending (its folder made), or ``None`` without a partial file."""
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a", encoding="utf-8")


def append_piece(sink: IO[str] | None, key: str, index: int, piece: dict[str, Any]) -> None:
    """One finished piece as a line of the partial file, flushed (an interrupt keeps it)."""
    if sink is not None:
        sink.write(json.dumps({"key": key, "index": index, "cell": piece}, allow_nan=False) + "\n")
        sink.flush()

"""Kill tests: SIGINT or SIGKILL at any point of ``k3verify run`` and ``k3verify golden generate``
leaves the folder holding either the previous set of files or the new one, never a mix.

Rule: structural. Each trial restores the previous set (made with ``--seed 0``), starts the
command with ``--seed 1`` in a fresh process, kills it after a fraction of an uninterrupted
run's time, and compares every file of the folder with the two sets. CI kills at 45 % and 80 %
(while it computes and while it writes; :data:`CI_FRACTIONS`); ``-m slow`` draws 25 fractions
between 30 % and 105 %.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS: dict[str, Callable[[Path, int], list[str]]] = {
    # One module's run writes the whole report set; Block AttnRes's backward does it in 8 s, where
    # Stable LatentMoE's forward (its Triton-interpreter kernels) took 23 s.
    "run": lambda folder, seed: ["run", "--modules", "attnres_backward", "--out", str(folder), "--maps",
                                 str(folder.parent), "--seed", str(seed)],
    "golden generate": lambda folder, seed: ["golden", "generate", "--dir", str(folder), "--modules", "mla",
                                             "--seed", str(seed)],
}


def _interruptible() -> None:
    # A process started in the background of a shell without job control inherits SIGINT ignored,
    # and Python then never turns it into KeyboardInterrupt: give the child the default back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(command: str, folder: Path, seed: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "k3verify", *COMMANDS[command](folder, seed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT,
                            preexec_fn=_interruptible)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _seeds(files: dict[str, bytes]) -> set[str]:
    """The seed each report file says it was made with (a report's files carry the time they
    were made, so a report set is recognised by its seed, not by its bytes)."""
    seeds = set()
    for name, data in files.items():
        if name.endswith(".json"):
            seeds.add(str(json.loads(data)["config"]["seed"]))
        else:
            seeds.add("1" if b"--seed 1" in data else "0" if b"--seed 0" in data else "?")
    return seeds


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[float, Path, dict[str, bytes]]]:
    """Per command: an uninterrupted run's time (the shorter of two: the first start of a process
    can be slower, cold caches, and kill points placed on it could fall after a warm run has
    ended), a folder with the previous set (seed 0) and a snapshot of the new set (seed 1).
    ``run`` makes only its seed-0 set: a report set is told by its names and seed (:func:`_seeds`),
    and the new set has the old one's names; that one start times it (pytest has warmed the caches)."""
    out = {}
    for command in COMMANDS:
        base = tmp_path_factory.mktemp(command.replace(" ", "_"))
        durations = []
        seeds = ((1, base / "new"), (0, base / "old")) if command == "golden generate" else ((0, base / "old"),)
        for seed, folder in seeds:
            start = time.perf_counter()
            assert _start(command, folder, seed).wait(timeout=300) == 0
            durations.append(time.perf_counter() - start)
        new = base / "new" if command == "golden generate" else base / "old"
        out[command] = (min(durations), base / "old", _snapshot(new))
    return out


def _trials(command: str, sig: signal.Signals, fractions: list[float], tmp_path: Path,
            sets: dict[str, tuple[float, Path, dict[str, bytes]]], *, until_stopped: bool = False) -> list[str]:
    """One trial per fraction of the uninterrupted time; with ``until_stopped``, no more after
    the first that stops a run (later fractions are fallbacks for a run faster than timed)."""
    duration, pristine, new = sets[command]
    old = _snapshot(pristine)
    folder = tmp_path / "out"
    outcomes, interrupted = [], 0
    for fraction in fractions:
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        delay = fraction * duration
        proc = _start(command, folder, 1)
        time.sleep(delay)
        proc.send_signal(sig)
        code = proc.wait(timeout=300)
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert "Traceback" not in err, err
        state = _snapshot(folder)
        if command == "golden generate":
            kind = "old" if state == old else "new" if state == new else "mix"
        else:
            same_names = set(state) == set(new) == set(old)
            kind = "old" if same_names and _seeds(state) == {"0"} else "new" if same_names and _seeds(state) == {
                "1"} else "mix"
        assert kind != "mix", f"{command}: {sig.name} after {delay:.2f} s left {sorted(state)} (exit {code})"
        if sig == signal.SIGINT and code != 0:
            assert code == 130 and "interrupted" in err, (code, err)
        interrupted += code != 0
        if sig == signal.SIGINT:  # a clean exit leaves no staging folder behind
            assert not [p for p in tmp_path.iterdir() if "staging" in p.name]
        outcomes.append(f"{delay:.2f}s:{kind}:exit {code}")
        if until_stopped and code != 0:
            break
    # The delays fall inside the run: a signal that never stops one would test nothing.
    assert interrupted, f"{command}: no {sig.name} stopped a run ({outcomes})"
    return outcomes


# Where CI kills: ``golden generate`` (seconds) at 45 % and 80 % for both signals; ``run`` (the
# dearer command) once per signal, SIGINT while it computes and SIGKILL late, while it writes,
# each with earlier points as fallbacks should a warm run finish sooner than the timed one. The
# slow test draws 25 points per pair.
CI_FRACTIONS = {("run", "SIGINT"): [0.45, 0.25], ("run", "SIGKILL"): [0.8, 0.55, 0.3]}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_kill_leaves_the_old_or_the_new_set(command: str, sig: signal.Signals, tmp_path: Path, sets: dict) -> None:
    fractions = CI_FRACTIONS.get((command, sig.name))
    _trials(command, sig, fractions or [0.45, 0.8], tmp_path, sets, until_stopped=fractions is not None)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_many_kill_points(command: str, sig: signal.Signals, tmp_path: Path, sets: dict) -> None:
    rng = random.Random(f"{command}/{sig.name}")
    outcomes = _trials(command, sig, [rng.uniform(0.3, 1.05) for _ in range(25)], tmp_path, sets)
    print(f"{command} {sig.name}: {len(outcomes)} kill points: {' '.join(outcomes)}")


def test_an_interrupt_swallowed_by_a_callback_reaches_the_command() -> None:
    """A SIGINT that lands in a callback Python cannot raise from (an import's module-lock
    finaliser) reaches the unraisable hook; the CLI's hook hands it back to the main thread, so
    the command stops with exit 130 instead of printing a traceback and running on."""
    import types

    from k3verify.cli import redeliver_interrupts

    seen = []
    hook = redeliver_interrupts(seen.append)
    hook(types.SimpleNamespace(exc_type=ValueError))
    assert len(seen) == 1  # anything else goes to the previous hook
    # The command's process has Python's own SIGINT handler; a test worker may not (pytest-xdist's
    # workers can run with SIGINT ignored, and interrupt_main then does nothing).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            hook(types.SimpleNamespace(exc_type=KeyboardInterrupt))
            time.sleep(5)  # the interrupt arrives from the helper thread while the main thread waits
    finally:
        signal.signal(signal.SIGINT, previous)

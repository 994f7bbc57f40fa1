"""No data loss, no crashes: what k3verify writes survives other writers, other programs and
full disks, and every bad input or hostile environment ends in one line with exit 1 or 2.

- Writing: a writer removes only its own folder's leftover staging folders (names with glob
  characters included), never swaps in a staging folder another program removed or changed,
  keeps the entries other programs create or replace in the folder meanwhile, takes the
  folder's lock before it computes anything and holds it to the end, and refuses a name whose
  staging folder would not fit the file system.
- Goldens: ``golden verify`` judges the bytes its check passed (the set is read once); each file
  must hold exactly the named outputs today's oracle makes for its case, in fp64, finite where
  the oracle is; a manifest's seed is bounded.
- Environment: 1200 nested folders, a full disk, inode table, quota or file-size limit, ``--tp``
  beyond the machine, a closed standard output.

Rules: structural (exit statuses, one-line messages naming the path, file or output, files
left as they were). The fuzz tests follow ``test_fuzz.py``: ``FUZZ_EXAMPLES`` derandomised
examples, or ``K3V_FUZZ_EXAMPLES=N`` fresh random ones.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from golden_memo import memoised_golden_cases
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from quick_forms import without_kernels
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from k3verify import cli
from k3verify.cli import main
from k3verify.harness import decoder_walk, files, golden, registry, runner, tp_rows
from k3verify.harness.files import StagingError, UsageError, remove_tree, staged_folder

ROOT = Path(__file__).resolve().parents[1]
FUZZ_EXAMPLES = int(os.environ.get("K3V_FUZZ_EXAMPLES", "150"))
fuzz = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="K3V_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ROW = {"module": "mla", "implementation": "i", "form": "f", "dtype": "fp64", "params": {}, "case": "c",
       "rule": "fp64-agreement", "status": "pass", "verdict": {"err": 0.0, "limit": 1e-10}, "margin": 1.0}
STAGING = ".k3verify-staging-"
DEPTH = 1200  # beyond Python's recursion limit (1000)


def _stub_run(monkeypatch: pytest.MonkeyPatch, during: Callable[[], None] | None = None) -> None:
    """``runner.run`` yields one passing row, after calling ``during`` (what happens meanwhile)."""

    def run(entries: Any, seed: int, progress: Any, **kw: Any) -> Iterator[dict[str, Any]]:
        if during:
            during()
        yield ROW

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(runner, "plan", lambda *a, **k: [ROW])  # one row planned, one made


def _no_maps(tmp_path: Path) -> str:
    """An empty maps folder beside ``tmp_path`` (whose listing some tests compare): the page shows
    no maps (a missing folder is a usage error)."""
    folder = tmp_path.with_name(f"{tmp_path.name}-no-maps")
    folder.mkdir(exist_ok=True)
    return str(folder)


def _refuse_computing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the computation started before the folder was checked and locked")

    for owner, name in ((runner, "run"), (golden, "generate"), (golden, "snapshot"), (cli, "render_report"),
                        (cli, "sweep_map"), (decoder_walk, "run_all")):
        monkeypatch.setattr(owner, name, refuse)


def _one_line(err: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _one_error(err: str) -> None:
    """Among progress lines, one error line and no traceback."""
    assert "Traceback" not in err and len([x for x in err.splitlines() if x.startswith("k3verify:")]) == 1, err


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def deep(tmp_path: Path) -> Iterator[None]:
    """Removes the test's folders afterwards: pytest's own clean-up of old temporary folders
    recurses, and would fail on deep ones."""
    yield
    remove_tree(tmp_path)


def _nest(root: Path, depth: int) -> Path:
    """``root/a/a/.../a`` ``depth`` folders deep (made one by one: ``os.makedirs`` recurses)."""
    path = root
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(depth):
        path = path / "a"
        path.mkdir()
    (path / "deepest.txt").write_text("deep")
    return path


@contextlib.contextmanager
def _held_elsewhere(folder: Path) -> Iterator[None]:
    """Another process holds ``folder``'s writer's lock while the block runs."""
    lock = folder.parent / f".{folder.name}.k3verify-lock"
    folder.parent.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield
    finally:
        proc.kill()
        proc.wait()


def _locked_elsewhere(folder: Path) -> bool:
    """Whether another process would find ``folder``'s writer's lock taken."""
    lock = folder.parent / f".{folder.name}.k3verify-lock"
    code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)\n"
            "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, str(lock)]).returncode == 3


# --- leftovers: only the folder's own ---------------------------------------------------------

# (the folder written, another folder beside it): a glob built from the first name matched the
# second one's staging folders.
NEIGHBOURS = [("g*", "gA"), ("g?", "gA"), ("[gA]", "g"), ("g[!x]", "gA"), ("gA", "gA.k3verify-staging-b"),
              ("**", "gA")]


@pytest.mark.parametrize(("name", "other"), NEIGHBOURS)
def test_a_writer_never_removes_another_folders_staging_folder(name: str, other: str, tmp_path: Path) -> None:
    live = tmp_path / f".{other}{STAGING}abcd1234"  # a live writer's staging folder, half written
    live.mkdir()
    (live / "report.json").write_text("being written")
    with staged_folder(tmp_path / name, carry=lambda n: True) as stage:
        (stage / "x").write_text("x")
    assert (live / "report.json").read_text() == "being written"


def test_report_render_of_a_glob_named_folder_spares_a_live_golden_generate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reproduction: ``report render 'D/g*'`` removed ``D/.gA.k3verify-staging-…`` of a live
    ``golden generate --dir D/gA``."""
    _stub_run(monkeypatch)
    glob_named, maps = tmp_path / "g*", _no_maps(tmp_path)
    assert main(["run", "--modules", "mla", "--out", str(glob_named), "--maps", maps]) == 0
    live = tmp_path / f".gA{STAGING}k3x_9zq1"
    (live / "mla").mkdir(parents=True)
    (live / "mla" / "default.safetensors").write_bytes(b"being written")
    capsys.readouterr()
    assert main(["report", "render", str(glob_named), "--maps", maps]) == 0
    assert (live / "mla" / "default.safetensors").read_bytes() == b"being written"


@pytest.mark.parametrize("name", ["out", "g[1]", "g*", "a?b", "sp ace", "x]y[", "{a,b}"])
@pytest.mark.parametrize("suffix", ["", "-old"])
def test_a_killed_writers_leftovers_are_removed_whatever_the_name(name: str, suffix: str, tmp_path: Path) -> None:
    stale = tmp_path / f".{name}{STAGING}abcd1234{suffix}"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "report.json").write_text("stale")
    with staged_folder(tmp_path / name, carry=lambda n: True) as stage:
        (stage / "x").write_text("x")
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, f".{name}.k3verify-lock"])


NAME_CHARS = st.sampled_from([*"ab*?[]!^-_.{},\\ ", "k3verify-staging-", "x"])


@fuzz
@given(mine=st.lists(NAME_CHARS, min_size=1, max_size=6).map("".join),
       other=st.lists(NAME_CHARS, min_size=1, max_size=6).map("".join),
       random=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=8, max_size=8))
def test_fuzzed_names_clean_only_their_own_leftovers(mine: str, other: str, random: str, tmp_path: Path) -> None:
    """Rule: structural. Whatever the two names, writing the first removes its own leftover
    staging folder and never the second's."""
    assume(mine not in (".", "..") and other not in (".", ".."))
    with _tempdir(tmp_path) as folder:
        own, others = folder / f".{mine}{STAGING}{random}", folder / f".{other}{STAGING}{random}"
        others.mkdir()
        own.mkdir(exist_ok=True)
        with staged_folder(folder / mine, carry=lambda n: True) as stage:
            (stage / "x").write_text("x")
        assert not own.exists()
        assert others.exists() or mine == other


@contextlib.contextmanager
def _tempdir(base: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        yield Path(tmp)


# --- the staging folder: swapped in only as written ---------------------------------------------


def _remove_stage(stage: Path) -> None:
    remove_tree(stage)


def _remove_and_remake_stage(stage: Path) -> None:
    remove_tree(stage)
    stage.mkdir()
    (stage / "report.json").write_text("someone else's")


def _empty_stage(stage: Path) -> None:
    for p in stage.iterdir():
        remove_tree(p)


def _add_to_stage(stage: Path) -> None:
    (stage / "intruder").write_text("x")


DAMAGES = [(damage, when) for damage in (_remove_stage, _remove_and_remake_stage, _empty_stage, _add_to_stage)
           for when in ("while writing", "after the flush") if (damage, when) != (_add_to_stage, "while writing")]


@pytest.mark.parametrize(("damage", "when"), DAMAGES, ids=[f"{d.__name__[1:]} {w}" for d, w in DAMAGES])
def test_a_damaged_staging_folder_is_never_swapped_in(damage: Callable[[Path], None], when: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program (a cleaner with a too wide pattern) removes, remakes, empties or adds to
    the staging folder: nothing is swapped in, the previous folder stays, one error."""
    out = tmp_path / "out"
    with staged_folder(out, carry=lambda n: False) as stage:
        (stage / "report.json").write_text("old")
    if when == "after the flush":  # between the last flush and the swap
        settle = files._settle

        def settle_then_damage(stage: Path) -> Any:
            settled = settle(stage)
            damage(stage)
            return settled

        monkeypatch.setattr(files, "_settle", settle_then_damage)
    with pytest.raises(StagingError), staged_folder(out, carry=lambda n: False) as stage:
        (stage / "report.json").write_text("new")
        (stage / "report.md").write_text("new")
        if when == "while writing":
            damage(stage)
    assert _snapshot(out) == {"report.json": b"old"}
    assert not [p for p in tmp_path.iterdir() if STAGING in p.name]


def test_golden_generate_whose_staging_folder_vanishes_keeps_the_old_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reproduction: the staging folder of ``golden generate`` removed mid-way (by the
    leftover cleaning of another writer) left the folder empty with exit 0."""
    folder = tmp_path / "gA"
    assert main(["golden", "generate", "--dir", str(folder), "--modules", "attnres,mla"]) == 0
    before = _snapshot(folder)
    real = golden._generate_module

    def then_removed(entry: registry.ModuleEntry, stage: Path, *args: Any) -> Any:
        made = real(entry, stage, *args)
        if entry.name == "attnres":
            remove_tree(stage)
        return made

    monkeypatch.setattr(golden, "_generate_module", then_removed)
    capsys.readouterr()
    code, err = _run(["golden", "generate", "--dir", str(folder), "--modules", "attnres,mla", "--seed", "1"], capsys)
    assert code == 2 and "staging folder was removed" in err
    _one_error(err)
    assert _snapshot(folder) == before


# --- other programs' entries survive the swap -----------------------------------------------------


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_entries_others_write_meanwhile_are_kept(exchange: bool, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    with staged_folder(out, carry=lambda n: False) as stage:
        for name in ("report.json", "notes.txt"):
            (stage / name).write_text("v1")
        (stage / "extra").mkdir()
        (stage / "extra" / "a.txt").write_text("v1")
    with staged_folder(out, carry=lambda n: n != "report.json") as stage:
        (stage / "report.json").write_text("v2")
        # another program, while the new version is built:
        (out / "nightly.json").write_text("theirs")  # creates
        (out / "tmp").write_text("theirs, replaced")
        os.replace(out / "tmp", out / "notes.txt")  # replaces (write-and-rename)
        (out / "extra" / "b.txt").write_text("theirs")  # creates inside a kept folder
        (out / "report.json").write_text("theirs, but the writer rewrites this one")
    assert _snapshot(out) == {"report.json": b"v2", "notes.txt": b"theirs, replaced", "nightly.json": b"theirs",
                              "extra/a.txt": b"v1", "extra/b.txt": b"theirs"}
    assert not [p for p in tmp_path.iterdir() if STAGING in p.name]


def test_files_written_during_many_swaps_all_survive(tmp_path: Path) -> None:
    """The reproduction: files another program wrote into the folder during the swap were
    dropped (9 of 50 tries). Here a thread writes 200 files (half of them write-and-rename)
    while 20 writers swap the folder."""
    out = tmp_path / "out"
    with staged_folder(out, carry=lambda n: True) as stage:
        (stage / "report.json").write_text("0")
    written: list[str] = []
    stop = threading.Event()

    def other_program() -> None:
        for i in range(200):
            if stop.is_set():
                break
            name = f"note-{i}"
            with contextlib.suppress(FileNotFoundError):  # the rename met the swap: not written
                if i % 2:
                    (out / name).write_text(name)
                else:
                    (out / f"{name}.tmp").write_text(name)
                    os.replace(out / f"{name}.tmp", out / name)
                written.append(name)
            time.sleep(0.02)  # spread over the writers' swaps

    thread = threading.Thread(target=other_program)
    thread.start()
    try:
        for i in range(20):
            with staged_folder(out, carry=lambda n: n != "report.json") as stage:
                (stage / "report.json").write_text(str(i))
    finally:
        stop.set()
        thread.join()
    present = {p.name for p in out.iterdir()}
    assert written and not [n for n in written if n not in present]
    assert all((out / n).read_text() == n for n in written)


# --- the lock: first, and to the end ------------------------------------------------------------

COMMANDS = {
    "run": lambda d: ["run", "--modules", "mla", "--out", str(d)],
    "golden generate": lambda d: ["golden", "generate", "--dir", str(d), "--modules", "mla"],
    "golden verify --out": lambda d: ["golden", "verify", "--modules", "mla", "--out", str(d)],
    "report render": lambda d: ["report", "render", str(d)],
    "overflow-map": lambda d: ["overflow-map", "--module", "kda", "--out", str(d)],
    "walk": lambda d: ["walk", "--layers", "4", "--out", str(d)],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_folder_another_process_writes_is_refused_before_computing(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _refuse_computing(monkeypatch)
    folder = tmp_path / "out"
    with _held_elsewhere(folder):
        code, err = _run(COMMANDS[command](folder), capsys)
    assert code == 2 and "another k3verify process is writing" in err and str(folder) in err
    _one_line(err)


def test_the_lock_is_held_from_the_start_to_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    seen = []
    _stub_run(monkeypatch, during=lambda: seen.append(_locked_elsewhere(out)))
    assert main(["run", "--modules", "mla", "--out", str(out), "--maps", _no_maps(tmp_path)]) == 0
    assert seen == [True] and not _locked_elsewhere(out)


def test_the_lock_is_reentrant_but_one_staged_write_at_a_time(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with files.hold_output_folder(out), staged_folder(out, carry=lambda n: True) as stage:
        (stage / "a").write_text("a")
        with pytest.raises(UsageError, match="another k3verify process is writing"):
            with staged_folder(out, carry=lambda n: True):
                pass
    assert (out / "a").read_text() == "a" and not files._HELD


@pytest.mark.parametrize("where", ["name", "path"])
def test_a_name_too_long_for_its_staging_folder_is_refused_first(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 240-byte name fits NAME_MAX (255) but ``.<name>.k3verify-staging-XXXXXXXX-old`` does not;
    a path near PATH_MAX leaves no room for the staging folder's."""
    _refuse_computing(monkeypatch)
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    if where == "name":
        out = tmp_path / ("n" * (name_max - 15))
    else:
        out = tmp_path
        while len(str(out)) < path_max - 40:
            out = out / ("p" * 200)
    code, err = _run(["run", "--modules", "mla", "--out", str(out)], capsys)
    assert code == 2 and "too long" in err and str(out) in err
    _one_line(err)
    assert not any(tmp_path.iterdir())


# --- goldens: the set read once ---------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per module, a golden folder holding only that module (checked in a second or two)."""
    base = tmp_path_factory.mktemp("goldens")
    out = {}
    for module in registry.module_names():
        out[module] = base / module
        golden.generate(out[module], modules=[module])
    return out


@pytest.fixture
def mla_goldens(made: dict[str, Path], tmp_path: Path) -> Path:
    target = tmp_path / "golden"
    shutil.copytree(made["mla"], target)
    return target


def _reseal(folder: Path, rel: str, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Edit ``rel``'s tensors through ``change`` and reseal it as a careful forger would: the
    file's own header, the manifest's record (tensors, sha256, bytes) and the digests."""
    path = folder / rel
    data = path.read_bytes()
    tensors = dict(load_tensors(data))
    header = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
    meta = json.loads(header["__metadata__"][golden.HEADER_KEY])
    change(tensors)
    record = meta["record"]
    record["tensors"] = {k: {"sha256": golden.tensor_sha256(t), "dtype": str(t.dtype).removeprefix("torch."),
                             "shape": list(t.shape)} for k, t in sorted(tensors.items())}
    new = save_tensors({k: t.contiguous() for k, t in tensors.items()},
                       metadata={golden.HEADER_KEY: json.dumps(meta, sort_keys=True)})
    path.write_bytes(new)
    doc = json.loads((folder / golden.MANIFEST).read_text())
    doc["files"][rel] = record | {"sha256": golden._sha256(new), "bytes": len(new)}
    doc["digests"] = golden.digests(doc)
    (folder / golden.MANIFEST).write_text(json.dumps(doc))


def _scale_oracles(folder: Path) -> None:
    """Double every stored oracle output, without resealing: a set no check would pass."""
    for rel in json.loads((folder / golden.MANIFEST).read_text())["files"]:
        tensors = dict(load_tensors((folder / rel).read_bytes()))
        data = (folder / rel).read_bytes()
        header = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
        scaled = {k: (t * 2 if k.startswith("oracle.") and t.is_floating_point() else t) for k, t in tensors.items()}
        (folder / rel).write_bytes(save_tensors(scaled, metadata=header["__metadata__"]))


def test_verify_judges_the_set_its_check_passed(
    mla_goldens: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reproduction: a ``golden generate`` swapping the folder between the check and the
    rows made the rows judge files the check never saw. Here the folder is swapped for one whose
    oracles are doubled (no check would pass it) right after the check."""
    forged = tmp_path / "forged"
    shutil.copytree(mla_goldens, forged)
    _scale_oracles(forged)
    real_check = golden.check

    def check_then_swap(goldens: Any) -> list[str]:
        problems = real_check(goldens)
        if not swapped:
            swapped.append(files._exchange(forged, mla_goldens))
        return problems

    swapped: list[bool] = []

    monkeypatch.setattr(golden, "check", check_then_swap)
    without_kernels(monkeypatch, "mla")
    out = tmp_path / "report"
    assert main(["golden", "verify", "--dir", str(mla_goldens), "--modules", "mla", "--out", str(out)]) == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert rows and not [r for r in rows if r["status"] == "fail"]
    assert swapped == [True] and real_check(mla_goldens) != []  # the folder there now is the forged one


def test_a_snapshot_reads_one_folder_even_if_swapped_while_reading(
    made: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest and the files come from the same folder, even when another set takes the
    folder's name between reading the manifest and reading the files."""
    first, second = tmp_path / "golden", tmp_path / "other"
    shutil.copytree(made["mla"], first)
    golden.generate(second, modules=["mla"], seed=3)
    real = golden._read_manifest

    def read_then_swap(directory: Path, fd: int) -> dict[str, Any]:
        manifest = real(directory, fd)
        files._exchange(first, second)
        return manifest

    monkeypatch.setattr(golden, "_read_manifest", read_then_swap)
    goldens = golden.snapshot(first)
    assert goldens.manifest["seed"] == 0 and golden.check(goldens) == []


def test_verify_rows_refuses_a_set_that_does_not_check_out(mla_goldens: Path) -> None:
    _scale_oracles(mla_goldens)
    with pytest.raises(golden.GoldenError, match="do not check out"):
        golden.verify_rows(mla_goldens, modules=["mla"])


# --- goldens: every named output, as the oracle makes it -----------------------------------------


def _oracle_keys(folder: Path) -> dict[str, list[str]]:
    files_ = json.loads((folder / golden.MANIFEST).read_text())["files"]
    return {rel: sorted(k for k in r["tensors"] if k.startswith("oracle.")) for rel, r in files_.items()}


def _drops() -> list[tuple[str, str]]:
    """(module, output) for every output some golden file of the module stores."""
    return [("kda", "o"), ("kda", "final_state"), ("mla", "o"), ("mla", "cache"), ("attnres", "h"),
            ("attnres", "blocks"), ("moe", "y"), ("moe", "experts")]


@pytest.mark.parametrize(("module", "output"), _drops())
def test_a_removed_output_is_named(module: str, output: str, made: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "golden"
    shutil.copytree(made[module], folder)
    key = f"oracle.{output}"
    rel = next(rel for rel, keys in _oracle_keys(folder).items() if key in keys)
    _reseal(folder, rel, lambda t: t.pop(key))
    try:
        problems = golden.check(folder)
    except golden.GoldenError as exc:  # the file's only output: the manifest lists none
        problems = [str(exc)]
    assert any(rel in p and (f"'{output}' is missing" in p or "no oracle.<output>" in p) for p in problems), problems


def test_attnres_blocks_exist_only_in_walk_cases(made: dict[str, Path], tmp_path: Path) -> None:
    """AttnRes's ``blocks`` output is a walk's; a non-walk file that adds one is named."""
    folder = tmp_path / "golden"
    shutil.copytree(made["attnres"], folder)
    keys = _oracle_keys(folder)
    walks = [rel for rel, k in keys.items() if "oracle.blocks" in k]
    plain = [rel for rel, k in keys.items() if "oracle.blocks" not in k]
    assert walks and plain and all("walk" in rel for rel in walks)
    _reseal(folder, plain[0], lambda t: t.__setitem__("oracle.blocks", t["oracle.h"][None].clone()))
    problems = golden.check(folder)
    assert any(str(folder / plain[0]) in p and "'blocks' is not one today's oracle makes" in p for p in problems)


FORGERIES: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    "stored in fp32": (lambda t: t.__setitem__("oracle.o", t["oracle.o"].float()), "'o' is stored as float32"),
    "renamed": (lambda t: t.__setitem__("oracle.x", t.pop("oracle.o")), "'o' is missing"),
    "emptied": (lambda t: t.__setitem__("oracle.o", t["oracle.o"][:0]), "'o' has shape"),
    "a NaN": (lambda t: t["oracle.o"].view(-1).__setitem__(0, float("nan")), "non-finite value(s) where"),
    "an infinity": (lambda t: t["oracle.o"].view(-1).__setitem__(3, float("inf")), "non-finite value(s) where"),
    "an empty name": (lambda t: t.__setitem__("oracle.", t["oracle.o"].clone()), "'' is not one today's"),
    "a stray tensor": (lambda t: t.__setitem__("junk", t["oracle.o"].clone()), "neither inputs"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_oracle_is_one_named_problem(forgery: str, mla_goldens: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The reproductions: each of these, resealed, made ``golden verify`` end in a traceback
    (or pass); now each is a problem naming the file and the output, exit 1."""
    change, message = FORGERIES[forgery]
    rel = "mla/default.safetensors"
    _reseal(mla_goldens, rel, change)
    code, err = _run(["golden", "verify", "--dir", str(mla_goldens), "--modules", "mla"], capsys)
    assert code == 1 and "Traceback" not in err
    assert any(str(mla_goldens / rel) in line and message in line for line in err.splitlines()), err


@pytest.fixture(scope="module")
def memoised(made: dict[str, Path]) -> Iterator[Path]:
    """MLA's goldens, with the check's regeneration of the cases memoised per seed (it is
    deterministic, and the cases cache today's oracle)."""
    with memoised_golden_cases():
        yield made["mla"]


EDITS = st.sampled_from(["dtype", "narrow", "unsqueeze", "nan", "inf", "rename", "drop", "duplicate"])


@fuzz
@given(which=st.integers(0, 99), key_index=st.integers(0, 9), edit=EDITS,
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.float64]),
       name=st.text(min_size=0, max_size=8), position=st.integers(0, 10**6))
def test_fuzzed_resealed_outputs_never_pass_or_crash(memoised: Path, which: int, key_index: int, edit: str,
                                                     dtype: torch.dtype, name: str, position: int) -> None:
    with _tempdir(memoised.parent) as tmp:
        folder = Path(tmp) / "golden"
        shutil.copytree(memoised, folder, copy_function=os.link)
        keys = _oracle_keys(folder)
        rel = sorted(keys)[which % len(keys)]
        key = keys[rel][key_index % len(keys[rel])]
        (folder / rel).unlink()
        shutil.copy(memoised / rel, folder / rel)
        (folder / golden.MANIFEST).unlink()
        shutil.copy(memoised / golden.MANIFEST, folder / golden.MANIFEST)

        def change(t: dict[str, torch.Tensor]) -> None:
            x = t[key]
            if edit == "dtype":
                t[key] = x.to(dtype) if x.dtype != dtype else x.to(torch.float32 if dtype == torch.int64 else
                                                                    torch.int64)
            elif edit == "narrow" and x.dim():
                t[key] = x.narrow(position % x.dim(), 0, x.shape[position % x.dim()] - 1).clone()
            elif edit in ("narrow", "unsqueeze"):
                t[key] = x[None].clone()
            elif edit in ("nan", "inf"):
                x = x.double().clone() if not x.is_floating_point() else x.clone()
                x.view(-1)[position % x.numel()] = float(edit)
                t[key] = x
            elif edit == "rename":
                t["oracle." + name if f"oracle.{name}" != key else "oracle.x" + name] = t.pop(key)
            elif edit == "drop":
                t.pop(key)
            else:
                t["oracle.copy" + name] = x.clone()

        _reseal(folder, rel, change)
        try:
            problems = golden.check(folder)
        except golden.GoldenError as exc:
            problems = [str(exc)]
        assert problems, f"{edit} of {rel}:{key} checks out"
        assert any(str(folder / rel) in p for p in problems), problems


@pytest.mark.parametrize("seed", [2**64, 2**62, -1])
def test_a_manifest_seed_outside_the_generators_is_one_line(seed: int, mla_goldens: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads((mla_goldens / golden.MANIFEST).read_text())
    doc["seed"] = seed
    for record in doc["files"].values():
        record["seed"] = seed
    doc["digests"] = golden.digests(doc)
    (mla_goldens / golden.MANIFEST).write_text(json.dumps(doc))
    code, err = _run(["golden", "verify", "--dir", str(mla_goldens), "--modules", "mla"], capsys)
    assert code == 1 and "'seed'" in err and str(mla_goldens / golden.MANIFEST) in err
    _one_line(err)


def test_a_generate_seed_outside_the_generators_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="outside"):
        golden.generate(tmp_path / "g", modules=["mla"], seed=2**64)
    assert not (tmp_path / "g").exists()


# --- deep folders: no recursion ---------------------------------------------------------------


def test_run_carries_a_folder_1200_deep(tmp_path: Path, deep: None, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _stub_run(monkeypatch)
    out = tmp_path / "out"
    deepest = _nest(out / "notes", DEPTH)
    code, err = _run(["run", "--modules", "mla", "--out", str(out), "--maps", _no_maps(tmp_path)], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert (deepest / "deepest.txt").read_text() == "deep" and (out / "report.json").exists()


def test_golden_generate_keeps_a_folder_1200_deep(tmp_path: Path, deep: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "golden"
    deepest = _nest(folder / "notes", DEPTH)
    code, err = _run(["golden", "generate", "--dir", str(folder), "--modules", "mla"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert (deepest / "deepest.txt").read_text() == "deep"


def test_golden_verify_names_a_folder_1200_deep(mla_goldens: Path, deep: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _nest(mla_goldens / "mla" / "x", DEPTH)
    code, err = _run(["golden", "verify", "--dir", str(mla_goldens), "--modules", "mla"], capsys)
    assert code == 1 and "Traceback" not in err
    assert f"nested deeper than {golden.MAX_DEPTH} levels" in err


def test_a_killed_writers_staging_folder_1200_deep_is_removed(tmp_path: Path, deep: None) -> None:
    stale = tmp_path / f".out{STAGING}abcd1234"
    _nest(stale, DEPTH)
    with staged_folder(tmp_path / "out", carry=lambda n: True) as stage:
        (stage / "x").write_text("x")
    assert not stale.exists()


# --- full disks, inode tables, quotas, file-size limits -----------------------------------------


@contextlib.contextmanager
def _filesystem_full(root: Path, code: int) -> Iterator[Callable[[bool], None]]:
    """While the returned switch is on, creating a file or folder under ``root`` fails with
    ``code`` (ENOSPC: a full disk or inode table; EDQUOT: a quota; EFBIG: a file-size limit)
    and so does writing a new file; hard links, renames and removals still work."""
    full = [False]
    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def under(path: Any) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and str(os.path.abspath(os.fsdecode(path))).startswith(
            str(root))

    def refuse(path: Any) -> None:
        raise OSError(code, os.strerror(code), os.fsdecode(path))

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if full[0] and under(file) and any(c in mode for c in "wxa+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if full[0] and under(path) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR) and "dir_fd" not in kwargs:
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if full[0] and under(path):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        for owner in (builtins, io):
            mp.setattr(owner, "open", open_)
        mp.setattr(os, "open", os_open)
        mp.setattr(os, "mkdir", mkdir)
        yield lambda on: full.__setitem__(0, on)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG], ids=["ENOSPC", "EDQUOT", "EFBIG"])
def test_golden_generate_on_a_full_disk_is_one_line_and_keeps_the_old_set(
    code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "golden"
    assert main(["golden", "generate", "--dir", str(folder), "--modules", "mla"]) == 0
    before = _snapshot(folder)
    capsys.readouterr()
    with _filesystem_full(tmp_path, code) as switch:
        real = golden._generate_module

        def fills_meanwhile(*args: Any) -> Any:
            switch(True)
            return real(*args)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(golden, "_generate_module", fills_meanwhile)
            result, err = _run(["golden", "generate", "--dir", str(folder), "--modules", "mla", "--seed", "1"],
                               capsys)
    assert result == 2 and os.strerror(code) in err
    _one_error(err)
    assert _snapshot(folder) == before


def _python(code: str, *args: str, limit_bytes: int | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a file-size limit set, SIGXFSZ ignored, when asked)."""

    def limit() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          preexec_fn=limit if limit_bytes else None, timeout=300, **kwargs)


def test_golden_generate_past_a_file_size_limit_is_one_line_and_keeps_the_old_set(tmp_path: Path) -> None:
    """The reproduction: RLIMIT_FSIZE during ``golden generate`` kept the old set but ended in
    a SafetensorError traceback."""
    folder = tmp_path / "golden"
    golden.generate(folder, modules=["mla"])
    before = _snapshot(folder)
    largest = max(len(data) for data in before.values())
    command = "import sys\nfrom k3verify.__main__ import entry\nsys.argv[1:] = sys.argv[2:]\nsys.exit(entry())"
    done = _python(command, "k3verify", "golden", "generate", "--dir", str(folder), "--modules", "mla", "--seed",
                   "1", limit_bytes=largest // 2)
    assert done.returncode == 2, done.stderr
    assert "File too large" in done.stderr and f".{folder.name}.k3verify-staging-" in done.stderr
    _one_error(done.stderr)
    assert _snapshot(folder) == before


def test_run_on_a_full_inode_table_exits_non_zero_and_keeps_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out, maps = tmp_path / "out", _no_maps(tmp_path)
    _stub_run(monkeypatch)
    assert main(["run", "--modules", "mla", "--out", str(out), "--maps", maps]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    with _filesystem_full(tmp_path, errno.ENOSPC) as switch:
        switch(True)  # full from the start: refused before computing
        code, err = _run(["run", "--modules", "mla", "--out", str(out), "--maps", maps], capsys)
        assert code == 2 and "No space left on device" in err
        _one_line(err)
        switch(False)
        _stub_run(monkeypatch, during=lambda: switch(True))  # fills while computing
        code, err = _run(["run", "--modules", "mla", "--out", str(out), "--maps", maps, "--seed", "1"], capsys)
    assert code == 2 and "No space left on device" in err
    _one_error(err)
    assert _snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == [".out.k3verify-lock", "out"]


# On a real tmpfs in a private mount namespace (root only): $1 the mount point, $2 Python, $3 the
# driver below. The previous set is made, the file system filled, then the next set written.
REAL_FULL = {
    "run, inode table": ("nr_inodes=64", "run", "i=0; while touch \"$1/fill$i\" 2>/dev/null; do i=$((i+1)); done\n"
                         "rm \"$1/fill0\"  # one inode left: the check passes, the staging folder takes it"),
    "golden generate, disk": ("size=8m", "golden", "dd if=/dev/zero of=\"$1/fill\" bs=64k 2>/dev/null || true\n"
                              "truncate -s -1000k \"$1/fill\"  # a third of the new files fit"),
}
REAL_SCRIPT = r"""
set -e
mount -t tmpfs -o "$4" tmpfs "$1"
"$2" -c "$3" "$5" "$1/out" 0 >/dev/null
{fill}
set +e
"$2" -c "$3" "$5" "$1/out" 1 >/dev/null
echo "exit $?"
{count}
"""
DRIVER = """
import sys
from k3verify.harness import runner
row = {"module": "mla", "implementation": "i", "form": "f", "dtype": "fp64", "params": {}, "case": "c",
       "rule": "fp64-agreement", "status": "pass", "verdict": {"err": 0.0, "limit": 1e-10}, "margin": 1.0}
runner.run = lambda entries, seed, progress, **kw: iter([row])
runner.plan = lambda *args, **kw: [row]
from k3verify.__main__ import entry
kind, out, seed = sys.argv[1:]
if kind == "run":
    import tempfile
    sys.argv[1:] = ["run", "--modules", "mla", "--out", out, "--maps", tempfile.mkdtemp(), "--seed", seed]
else:
    sys.argv[1:] = ["golden", "generate", "--modules", "mla", "--dir", out, "--seed", seed]
sys.exit(entry())
"""


@pytest.mark.parametrize("case", list(REAL_FULL))
def test_a_real_full_file_system(case: str, tmp_path: Path) -> None:
    """The reproductions on a real file system: ``run`` on a full inode table and ``golden
    generate`` on a full disk (a SafetensorError traceback) exit 2 in one line and keep the
    previous set."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to mount a tmpfs in a private mount namespace")
    options, kind, fill = REAL_FULL[case]
    count = ("grep -c '\"seed\": 0' \"$1/out/report.json\"" if kind == "run" else
             "grep -c '\"seed\": 0' \"$1/out/manifest.json\"; ls \"$1/out/mla\" | wc -l")
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = REAL_SCRIPT.format(fill=fill, count=count)
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(mount), sys.executable, DRIVER, options,
                           kind], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1"))
    if "exit" not in done.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[-200:]}")
    lines = done.stdout.split()
    assert lines[:2] == ["exit", "2"], (done.stdout, done.stderr)
    assert int(lines[2]) >= 1 and (kind == "run" or int(lines[3]) == 4), done.stdout  # the previous set
    assert "No space left on device" in done.stderr
    _one_error(done.stderr)


# --- --tp: what the machine can hold ------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--tp", "1000"], ["--tp", str(10**30)], ["--tp", "0"], ["--tp", "-3"],
                                  ["--tp", "2", "--tp-timeout", "1e308"], ["--tp", "2", "--tp-timeout", "0"],
                                  ["--tp", "2", "--tp-timeout", "nan"], ["--tp", "2", "--tp-timeout", "inf"]])
def test_tp_arguments_beyond_any_machine_are_usage_errors(argv: list[str], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_computing(monkeypatch)
    code, err = _run(["run", *argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and argv[-2] in err and "Traceback" not in err, err
    with pytest.raises(ValueError):
        tp_rows.TPOptions(int(argv[1]) if len(argv) == 2 else 2,
                          timeout_s=float(argv[3]) if len(argv) == 4 else 300.0)


def test_tp_beyond_this_machines_memory_is_refused_before_any_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _refuse_computing(monkeypatch)
    monkeypatch.setattr(tp_rows, "_mem_available", lambda: 2 * 2**30)
    code, err = _run(["run", "--tp", "8", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "2.0 GiB available" in err and "--tp 7 at most" in err
    _one_line(err)
    code, err = _run(["run", "--tp", "2", "--tp-size", "k3", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "k3 widths" in err
    tp_rows.check_machine(tp_rows.TPOptions(8), available_bytes=64 * 2**30)  # fits


@pytest.mark.parametrize("argv", [["--modules", "attnres_backward"], ["--direction", "backward"]])
def test_a_tp_run_of_modules_without_a_sharded_form_is_refused(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Structural: ``--tp`` on modules none of which has a sharded form planned 0 rows and exited
    0, a green CI step that verified nothing; it is a usage error naming the modules that have one."""
    _refuse_computing(monkeypatch)
    code, err = _run(["run", "--tp", "2", *argv, "--goldens", "none", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "has a sharded form" in err and "attnres, kda, mla, moe" in err, err
    _one_line(err)
    assert not (tmp_path / "out").exists()


def test_tp_beyond_the_process_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (8, 8))
    with pytest.raises(ValueError, match="process limit"):
        tp_rows.check_machine(tp_rows.TPOptions(8), available_bytes=2**40)


# --- a closed standard output -----------------------------------------------------------------

ENTRY = "import sys\nfrom k3verify.__main__ import entry\nsys.argv[1:] = sys.argv[2:]\nsys.exit(entry())"


@pytest.mark.parametrize("argv", [["list"], ["list", "--json"]])
def test_a_closed_standard_output_is_refused_in_one_line(argv: list[str]) -> None:
    """The reproduction: ``k3verify list >&-`` ended in a traceback."""
    done = subprocess.run([sys.executable, "-c", ENTRY, "k3verify", *argv], stderr=subprocess.PIPE, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 2 and "standard output is closed" in done.stderr
    _one_line(done.stderr)


@pytest.mark.parametrize("argv", [["list"], ["list", "--json"], ["list", "--modules", "kda"]])
def test_a_reader_that_went_away_is_one_line_and_exit_2(argv: list[str]) -> None:
    """A closed pipe: rich's console left silently with exit 1 (a failed verdict, as read by
    CI); print() raised BrokenPipeError."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before k3verify prints
    try:
        done = subprocess.run([sys.executable, "-c", ENTRY, "k3verify", *argv], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=dict(os.environ,
                                                                                       PYTHONPATH=str(ROOT)))
    finally:
        os.close(write)
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr)


def test_a_fifo_met_at_the_open_is_refused_without_waiting(tmp_path: Path) -> None:
    """A path checked as a regular file and swapped for a FIFO before it is opened: the bounded
    read opens without blocking and refuses what is not a regular file (the read is called on
    the FIFO directly, as after such a swap; a blocking open would wait for a writer forever)."""
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            files._read_bounded(fifo, 1000, "report")
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let the blocked open go, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("the read waited for a writer of the FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], UsageError) and "not a regular file" in str(outcome[0])

"""The harness end to end: `k3verify run`, its report, the KDA overflow map, and the verdicts
on deliberately broken implementations (structural checks; each verdict uses the rule the
registry names for the row)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from k3verify.cli import main
from k3verify.harness import registry, runner
from k3verify.harness.map_files import write_map
from k3verify.harness.overflow_map import MapOptions, agreement, mark_frontier, sweep_map
from k3verify.numerics import FAIL, PASS


def test_commit_without_git_comes_from_the_environment_or_a_stamp(monkeypatch, tmp_path) -> None:
    """Rule: structural. A tree copied without ``.git`` still names its commit; junk does not."""
    from k3verify.harness import environment as env

    commit = "0123456789abcdef0123456789abcdef01234567"
    # Declared beats a checkout: a copied tree may hold another commit's .git.
    monkeypatch.setenv(env.COMMIT_VARIABLE, f"{commit} dirty")
    assert env._git() == {"git_commit": commit, "git_dirty": True, "git_commit_source": "environment"}
    monkeypatch.setattr(env, "_git_checkout", lambda root: {"git_commit": None, "git_dirty": None})
    for junk in ("$(rm -rf /)", f"{commit} clean", f"{commit} dirty extra", "abc"):
        monkeypatch.setenv(env.COMMIT_VARIABLE, junk)
        assert env._git()["git_commit"] is None, junk
    monkeypatch.delenv(env.COMMIT_VARIABLE)
    root = tmp_path / "a" / "b"
    (root / "k3verify" / "harness").mkdir(parents=True)
    monkeypatch.setattr(env, "__file__", str(root / "k3verify" / "harness" / "environment.py"))
    (root / env.STAMP).write_text(commit[:12] + "\n")
    assert env._git() == {"git_commit": commit[:12], "git_dirty": False, "git_commit_source": "stamp"}


def test_unknown_module_is_a_clear_error(capsys) -> None:
    assert main(["run", "--modules", "kda,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown module 'nope'" in err and "kda" in err
    assert main(["run", "--modules", ""]) == 2  # an empty selection is not a vacuous pass
    assert "no module name given" in capsys.readouterr().err


def test_all_in_a_list_of_map_modules_is_named(capsys, tmp_path) -> None:
    """Structural: ``overflow-map --module all,kda`` is a usage error that says ``all`` stands
    alone (it used to read "unknown module 'all'", though ``all`` is a valid value); ``all`` alone
    and a list of modules stay valid (the other map tests run them)."""
    assert main(["overflow-map", "--module", "all,kda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'all' stands alone" in err and "unknown module" not in err, err


def test_a_dask_log_counts_its_cells_and_hears_from_a_long_first_cell() -> None:
    """Rule: structural. In a log the Dask engine's status goes through :class:`LineProgress`:
    lines per 10% of the tasks with their unit and the engine's note (failed, ETA), a line per
    failed task, and a "still running" line with the counts while no task ends (a GPU map's
    first cells compile for minutes)."""
    import io
    import time

    from rich.console import Console

    from k3verify.cli import LineProgress, _dask_status
    from k3verify.harness.dask_engine import SweepStatus

    buf = io.StringIO()
    console = Console(file=buf, width=200)
    with LineProgress(console, quiet_s=0.2) as bar:
        task = bar.add_task("kda overflow map", total=None)
        update = _dask_status(bar, task, console, "kda overflow map")
        status = SweepStatus(total=40)
        update(status)
        end = time.perf_counter() + 30
        while "still running" not in buf.getvalue() and time.perf_counter() < end:
            time.sleep(0.05)
        for done in range(1, 41):
            status.done = status.computed = done
            status.elapsed_s = done * 0.5
            if done == 7:
                status.failed, status.failures = 1, [(6, "worker died 3 times running this cell")]
            update(status)
    lines = buf.getvalue().splitlines()
    assert any(line.startswith("kda overflow map: 0/40 cells (0%) after ") and line.endswith(", still running")
               for line in lines), lines
    assert "kda overflow map: cell 6 failed: worker died 3 times running this cell" in lines, lines
    steps = [line for line in lines if "still" not in line and "failed:" not in line]
    assert [line.split(" after ")[0] for line in steps] == [
        f"kda overflow map: {n}/40 cells ({100 * n // 40}%)" for n in (0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40)], steps
    assert steps[2].endswith("; 1 failed, ETA 0:16"), steps[2]  # 32 left at 0.5 s each
    assert steps[-1].endswith("s; 1 failed"), steps[-1]  # done: no ETA


def test_a_command_that_draws_nothing_starts_without_matplotlib() -> None:
    """Rule: structural. The CLI and every module's registration import no plotting library:
    matplotlib is imported when a figure is drawn (0.7 s of every ``k3verify`` start measured
    on the development machine, 3.05 s against 3.75 s for ``k3verify list``)."""
    import subprocess
    import sys

    probe = ("import sys, k3verify.cli; from k3verify.harness import registry; "
             "registry.select(registry.module_names(opt_in=True)); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'PIL')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_list_shows_implementations(capsys) -> None:
    assert main(["list", "--modules", "kda"]) == 0
    assert "tiled" in capsys.readouterr().out


def _zero(case) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v).to(torch.bfloat16) for k, v in registry.get("kda").oracle(case).items()}


def _outputs(impl, case, change) -> dict[str, torch.Tensor]:
    return {k: change(v) for k, v in impl.run(case).items()}


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        (lambda impl: replace(impl, run=_zero), "all-zero output"),
        (lambda impl: replace(impl, run=lambda c: _outputs(impl, c, lambda t: (1.05 * t.float()).to(torch.bfloat16))),
         "5% gain error"),
        (lambda impl: replace(impl, run=lambda c: _outputs(impl, c, lambda t: t.flip(1))), "time-reversed output"),
    ],
    ids=["zero", "gain", "reversed"],
)
def test_broken_implementations_fail(broken, why) -> None:
    entry = registry.get("kda")
    good = next(i for i in entry.implementations() if i.form == "tiled" and i.dtype == "bf16")
    case = entry.make_cases(0)["default"]
    assert runner.verify(entry, good, case)["status"] == PASS
    assert runner.verify(entry, broken(good), case)["status"] == FAIL, why


def test_a_crashing_implementation_is_a_failed_row() -> None:
    entry = registry.get("kda")
    impl = replace(entry.implementations()[0], run=lambda c: 1 / 0)
    row = runner.verify(entry, impl, entry.make_cases(0)["default"])
    assert row["status"] == FAIL and "ZeroDivisionError" in row["reason"]


@pytest.fixture(scope="module")
def kda_map(tmp_path_factory):
    out = tmp_path_factory.mktemp("map")
    grid = [-1.0, -4.5, -5.0, -5.5, -6.0, -8.0, -12.0]
    result = sweep_map(registry.get("kda"), MapOptions(x_values=grid))
    return result, write_map(result, out, {"test": True})


def _cell(result, **key):
    matches = [c for c in result.cells if all(c[k] == v for k, v in key.items())]
    assert len(matches) == 1, key
    return matches[0]


def test_map_reproduces_spec_frontier(kda_map) -> None:
    result, _ = kda_map
    k3 = _cell(result, input="worst", dtype="bf16", tile=16, g_min=-5.0, anchor="tile_start")
    assert k3["finite"] and k3["predicted_finite"]
    assert not _cell(result, input="worst", dtype="bf16", tile=32, g_min=-5.0, anchor="tile_start")["finite"]
    # fla-core 0.6.0 safe_gate (row0 - 2/row, 16-row tiles, fp32 factors): finite at -6, NaN at -8.
    assert _cell(result, input="worst", dtype="fp32", tile=16, g_min=-6.0, anchor="row0_shift")["finite"]
    assert not _cell(result, input="worst", dtype="fp32", tile=16, g_min=-8.0, anchor="row0_shift")["finite"]


def test_map_agrees_with_its_prediction_away_from_the_frontier(kda_map) -> None:
    result, _ = kda_map
    for kind in ("worst", "random"):
        counts = agreement(result.cells, only=lambda c, kind=kind: c["input"] == kind and c["implementation"]
                           == "k3verify tiled")
        assert counts["disagree_away"] == 0, (kind, counts)
        assert counts["cells"] == 7 * 5 * 4 * 3


def test_map_files(kda_map) -> None:
    result, paths = kda_map
    doc = json.loads(paths[0].read_text())
    assert doc["module"] == "kda" and len(doc["cells"]) == len(result.cells)
    for key in ("module", "dtype", "tile", "g_min", "anchor", "finite", "predicted_finite", "rms_ratio"):
        assert key in doc["cells"][0]
    overflowed = [c for c in doc["cells"] if not c["finite"]]
    assert overflowed and all(c["rms_ratio"] is None and "overflowed" in c["overflow"] for c in overflowed)
    assert [p.suffix for p in paths] == [".json", ".png", ".png"]
    assert all(p.stat().st_size > 10_000 for p in paths[1:])


def test_frontier_marks_every_cell_that_shares_a_position() -> None:
    """Structural: two cells at one grid position (two registered kernels of one name and dtype
    that differ only in a parameter) are each marked against their neighbours, none left out."""

    def at(x: int, finite: bool, splits: int) -> dict:
        return {"implementation": "k", "dtype": "bf16", "x": x, "predicted_finite": finite, "splits": splits}

    cells = [at(0, True, 1), at(0, True, 4), at(1, False, 1), at(1, False, 4), at(2, False, 1)]
    mark_frontier(cells, {"x": [0, 1, 2]}, fixed=("implementation", "dtype"))
    assert [c["frontier_adjacent"] for c in cells] == [True, True, True, True, False]


def test_implementation_names_the_dtypes_it_casts_to() -> None:
    """Rule: structural. An fp8 dtype needs its scaling: implementation() refuses it by name."""
    from k3verify import mla
    from k3verify.harness.registry import IMPLEMENTATION_DTYPES, implementation

    with pytest.raises(ValueError, match="implementation\\(\\) takes dtype fp64, fp32, bf16, fp16, not 'fp8_e4m3'"):
        implementation("mla", mla.recurrent, name="x", dtype="fp8_e4m3")
    assert [implementation("mla", mla.recurrent, name="x", dtype=d).dtype for d in IMPLEMENTATION_DTYPES] == list(
        IMPLEMENTATION_DTYPES)


def test_a_maps_log_names_a_long_study_after_its_cells(tmp_path, monkeypatch, capsys) -> None:
    """Rule: structural. ``k3verify overflow-map`` in a log counts the map's points and then its
    studies, from 0 of the whole: a study that takes long (the AttnRes depth drift compiles the
    kernels it walks: two minutes on a fresh GPU) gets a "still running" line naming it, at the
    count of the points done, and the last line counts it done. Without the count a finished
    sweep said 100 % and then nothing while the study ran."""
    import time

    from k3verify import cli

    real = registry.get("attnres_backward")
    points = len(real.overflow_map.points(MapOptions(quick=True)))
    total = points + 1
    seen: list[str] = []  # the log's lines, read as it grows

    def slow_study(seed: int, quick: bool) -> dict:
        end = time.perf_counter() + 20
        while time.perf_counter() < end:
            seen.extend(capsys.readouterr().err.splitlines())
            if any(line.endswith("still running: study slow_study.json") for line in seen):
                break
            time.sleep(0.05)
        return {"title": "slow", "layers": [1], "error_x": [0.0], "metric": "rms_ratio"}

    entry = replace(real, studies={"slow_study.json": slow_study})
    monkeypatch.setattr(registry, "select", lambda names: [entry])
    monkeypatch.setattr(cli, "_progress", lambda console: cli.LineProgress(console, quiet_s=0.2))
    assert main(["overflow-map", "--module", "attnres_backward", "--quick", "--out", str(tmp_path)]) == 0
    lines = seen + capsys.readouterr().err.splitlines()
    head = "attnres_backward overflow map: "
    assert lines[0].startswith(f"{head}0/{total} (0%) after "), lines
    study = [line for line in lines if line.endswith("still running: study slow_study.json")]
    assert study and all(line.startswith(f"{head}{points}/{total} ") for line in study), lines
    assert lines[-1].startswith(f"{head}{total}/{total} (100%) after "), lines
    assert json.loads((tmp_path / "slow_study.json").read_text())["title"] == "slow"


def test_a_log_hears_from_a_long_step_and_nothing_after_the_command() -> None:
    """Rule: structural. In a log (no terminal) a step that prints nothing for ``quiet_s`` gets a
    "still running" line with its count and what it runs now (escaped), a finished task none, and
    the heartbeat ends with the command (no line after it)."""
    import io
    import time

    from rich.console import Console

    from k3verify.cli import LineProgress

    def wait_for(seen, limit_s: float = 30.0) -> None:
        end = time.perf_counter() + limit_s
        while not seen() and time.perf_counter() < end:
            time.sleep(0.05)

    buf = io.StringIO()
    with LineProgress(Console(file=buf, width=200), quiet_s=0.2) as bar:
        slow = bar.add_task("walking", total=5)
        bar.advance(slow)
        done = bar.add_task("drawing", total=1)
        bar.advance(done)
        wait_for(lambda: "still running" in buf.getvalue())
        # what runs now may come from a plugin's label: said, with its control characters visible
        bar.update(slow, current="kernels bf16: sublayer 3/8 (kda, x\x1b[2Jy)")
        wait_for(lambda: "still running: " in buf.getvalue())
    after = buf.getvalue()
    time.sleep(0.5)
    assert buf.getvalue() == after, "a line after the command ended"
    lines = after.splitlines()
    still = [line for line in lines if "still running" in line]
    assert still and all(line.startswith("walking: 1/5 (20%) after ") for line in still), lines
    assert still[0].endswith("still running"), lines
    assert still[-1].endswith("still running: kernels bf16: sublayer 3/8 (kda, x\\x1b[2Jy)"), lines
    assert "\x1b" not in after
    assert not any(line.startswith("drawing") and "still" in line for line in lines), lines

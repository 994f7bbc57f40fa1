"""The ``k3verify`` command line.

    k3verify run [--modules kda,mla] [--out reports/latest] [--seed 0] [--maps DIR] [--engine dask [--workers N]]
    k3verify overflow-map --module kda [--out reports/maps] [--quick] [--engine dask [--workers N]]
    k3verify list [--modules ...]
    k3verify golden generate [--dir golden] [--modules ...] [--seed 0]
    k3verify golden verify [--dir golden] [--modules ...] [--out DIR]
    k3verify report compare BASE NEW [--modules kda,mla]
    k3verify report render DIR [--maps DIR]

Exit status: 0 when every verdict passes (a predicted and observed overflow counts as
agreement, an unavailable implementation is reported but is not a verdict), 1 when any
verdict fails, the goldens do not check out or a compare finds a regression, 2 for usage and
I/O errors (an unknown module, a bad argument, a missing, malformed or unwritable file or
folder; checked before any long computation), 3 when the command could not complete (an
internal error, or a run short of a row it planned), 130 when interrupted (Ctrl-C): every
write is atomic, so an interrupted command leaves what was there before.
"""

from __future__ import annotations

import _thread
import argparse
import dataclasses
import errno
import functools
import json
import math
import os
import sys
import threading
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .harness import ci_output, compare, golden, registry, report, runner, sandbox, timing
from .harness.environment import code_version, environment
from .harness.files import UsageError, check_output_folder, hold_output_folder, json_safe
from .harness.map_files import check_maps_folder, default_maps_folder, write_map
from .harness.overflow_map import MapOptions, agreement, sweep_map
from .harness.partial import partial_path, remove_partial
from .harness.render import render_report, report_markdown, write_report
from .harness.text import terminal_text
from .harness.tp_rows import BACKENDS, MAX_TIMEOUT_S, MAX_WORLD_SIZE, SIZES, TPOptions, check_machine, default_backend
from .numerics import EXPECTED_NONFINITE, FAIL, PASS, UNAVAILABLE

# Text printed as given, one log line each whatever the width: data never read as rich markup.
PLAIN = dict(markup=False, highlight=False, soft_wrap=True, emoji=False)
STATUS_STYLE = {PASS: "green", FAIL: "bold red", EXPECTED_NONFINITE: "yellow", UNAVAILABLE: "dim"}


def _say(console: Console, text: object, style: str = "") -> None:
    """Print one line of text that may hold report, plugin or path data: every control and
    invisible character made visible (``terminal_text``), brackets never read as markup."""
    console.print(terminal_text(text), style=style, **PLAIN)


def _cell(text: object, style: str = "") -> Text:
    """A table cell of data: visible characters only, never markup."""
    return Text(terminal_text(text), style=style)


def _module_list(values: Sequence[str] | None) -> list[str] | None:
    """``--modules a,b --modules c`` -> ``["a", "b", "c"]`` (``None`` when not given)."""
    if values is None:
        return None
    return [name for v in values for name in v.split(",")]


class LineProgress:
    """Progress for logs (stderr not a terminal): one plain line per 10% step, with elapsed time
    (and the task's ``detail``), and a line saying the command is still running, and on what
    (the task's ``current``), after every ``quiet_s`` seconds without one (a wide walk's job, a
    map's first cells compiling: minutes in which a log showed nothing); also once the count is
    full, while the ``current`` given after it runs.

    Offers the subset of ``rich.progress.Progress`` the commands use.
    """

    STEP = 0.1
    QUIET_S = 60.0

    def __init__(self, console: Console, quiet_s: float = QUIET_S):
        self.console = console
        self.tasks: dict[int, dict] = {}
        self.quiet_s = quiet_s
        self._lock = threading.Lock()  # a line at a time: the heartbeat prints from its own thread
        self._stop = threading.Event()
        self._last_line = time.perf_counter()
        self._heartbeat: threading.Thread | None = None

    def __enter__(self) -> LineProgress:
        self._heartbeat = threading.Thread(target=self._beat, name="k3verify-progress", daemon=True)
        self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        return None

    def _beat(self) -> None:
        """Every unfinished task's count, once ``quiet_s`` has passed without a line."""
        while not self._stop.wait(min(1.0, self.quiet_s / 4)):
            with self._lock:
                if time.perf_counter() - self._last_line < self.quiet_s:
                    continue
                for t in list(self.tasks.values()):
                    if (t["total"] and t["completed"] < t["total"]) or t["after"]:
                        self._line(t, "still running" + (f": {t['current']}" if t["current"] else ""))
                self._last_line = time.perf_counter()

    def _line(self, t: dict, note: str = "") -> None:
        fraction = t["completed"] / t["total"]
        elapsed = time.perf_counter() - t["start"]
        unit = f" {t['unit']}s" if t["unit"] else ""
        detail = f"; {t['detail']}" if t["detail"] else ""
        _say(self.console, f"{t['description']}: {t['completed']:.0f}/{t['total']:.0f}{unit} "
                           f"({100 * fraction:.0f}%) after {elapsed:.1f} s{detail}" + (f", {note}" if note else ""))
        self._last_line = time.perf_counter()

    def add_task(self, description: str, total: float | None = None, **fields: object) -> int:
        with self._lock:
            self.tasks[len(self.tasks)] = dict(
                description=description, total=total, completed=0, shown=-1.0, start=time.perf_counter(), current="",
                unit="", detail="", after=False,
            )
            return len(self.tasks) - 1

    def update(
        self, task: int, *, completed: float | None = None, total: float | None = None, current: str | None = None,
        unit: str | None = None, detail: str | None = None,
    ) -> None:
        """New counts and texts: ``current`` what runs now (said by the heartbeat), ``unit`` what
        is counted (``cell``: "12/80 cells"), ``detail`` a note for every line (failed, ETA)."""
        with self._lock:
            t = self.tasks[task]
            for name, value in (("total", total), ("completed", completed), ("current", current), ("unit", unit),
                                ("detail", detail)):
                if value is not None:
                    t[name] = value
            # Work named once the count is full (a Dask map's studies, run after its last cell)
            # keeps the heartbeat going until the command ends.
            t["after"] = current is not None and bool(t["total"]) and t["completed"] >= t["total"]
            self._maybe_print(t)

    def advance(self, task: int, amount: float = 1) -> None:
        self.update(task, completed=self.tasks[task]["completed"] + amount)

    def _maybe_print(self, t: dict) -> None:
        if not t["total"]:
            return
        fraction = t["completed"] / t["total"]
        # 1e-9: 12/40 - 8/40 is a hair under 0.1 in floating point, and its line came one task late
        if fraction - t["shown"] >= self.STEP - 1e-9 or (fraction >= 1 and t["shown"] < 1):
            t["shown"] = fraction
            self._line(t)


class _CurrentColumn(ProgressColumn):
    """What is being verified (a row's label, which a plugin names): plain visible text."""

    def render(self, task: Task) -> Text:
        return _cell(task.fields.get("current", ""), style="dim")


def _progress(console: Console) -> Progress | LineProgress:
    """A live bar on a terminal, periodic lines in a log."""
    if not console.is_terminal:
        return LineProgress(console)
    return Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        _CurrentColumn(),
        console=console,
        transient=False,
    )


# Where the report pages look for overflow maps and curve files when --maps is not given:
# a fresh `k3verify overflow-map` output first, else the committed baseline maps.
MAPS_SEARCH = (Path("reports/maps"), Path("reports/baseline/maps"))


def _map_fallbacks(value: str | None, chosen: Path | None) -> tuple[Path, ...]:
    """Without ``--maps``, the other non-empty folders of :data:`MAPS_SEARCH` after the chosen
    one: a module or study the fresh maps lack is shown from the committed baseline maps, and
    says so. With ``--maps``, none."""
    if value is not None or chosen is None:
        return ()
    later = MAPS_SEARCH[MAPS_SEARCH.index(chosen) + 1:] if chosen in MAPS_SEARCH else ()
    return tuple(p for p in later if default_maps_folder((p,)) is not None)


def _maps_dir(value: str | None) -> Path | None:
    """The maps folder the pages show: ``--maps`` (``UsageError`` unless it is a folder reached
    without a symlink), else the first non-empty folder of :data:`MAPS_SEARCH` (one reached
    through a symlink is a ``UsageError`` too), else ``None``. Called before any computation."""
    if value is not None:
        return check_maps_folder(Path(value), "--maps")
    return default_maps_folder(MAPS_SEARCH)


Command = Callable[[argparse.Namespace, Console, Console], int]


def _writes(option: str, what: str) -> Callable[[Command], Command]:
    """A command that writes the folder named by ``args.<option>``: before it computes anything
    the folder is checked (a file, an unwritable place, a name too long for its staging folder)
    and its writer's lock taken, held until the command returns, so a folder another process is
    writing is refused at once instead of after the whole computation."""

    def wrap(command: Command) -> Command:
        @functools.wraps(command)
        def run(args: argparse.Namespace, out: Console, err: Console) -> int:
            folder = getattr(args, option)
            if folder is None:
                return command(args, out, err)
            with hold_output_folder(Path(folder), what):
                return command(args, out, err)

        return run

    return wrap


@_writes("out", "--out")
def cmd_run(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Verify every registered implementation of the selected modules; write the report."""
    entries = _in_direction(registry.select(_module_list(args.modules)), args.direction)
    maps_dir = _maps_dir(args.maps)
    tp = _tp_options(args)
    sandbox.set_timeout(args.timeout)
    start = time.perf_counter()
    orphans = args.modules is None
    names = _module_list(args.implementations)
    if names is not None and tp is not None:
        raise UsageError("--implementations selects rows of a plain run; a --tp run verifies the modules' layers")
    if args.time and tp is not None:
        raise UsageError("--time times the kernel rows of a plain run; a --tp run has none")
    engine = _dask_engine(args, "--row-timeout")
    if engine is not None:
        # Not yet on Dask: a --tp run starts its own ranks, and a time is only comparable with its
        # peer's when both ran on one device, one after the other.
        for flag, given in (("--tp", tp is not None), ("--time", args.time)):
            if given:
                raise UsageError(f"{flag}: not with --engine dask (run it with --engine local)")
    try:
        planned = runner.plan(entries, tp, orphans, names)
    except KeyError as exc:
        raise UsageError(f"--implementations: {exc.args[0]}") from None
    if tp is not None and not planned:  # a green run that verified nothing would read as a pass
        sharded = ", ".join(e.name for e in registry.select(None) if e.sharded is not None)
        raise UsageError(f"--tp: none of the selected modules ({', '.join(e.name for e in entries)}) has a sharded "
                         f"form; those with one: {sharded}")
    oracle_rows, oracle_check = _oracle_check(args, entries, tp, err)
    rows = list(oracle_rows)
    config: dict[str, Any] = {}
    if engine is not None:
        rows += _rows_on_dask(args, planned, engine, err, config)
    else:
        with _progress(err) as bar:
            task = bar.add_task("verifying", total=len(planned), current="")
            for row in runner.run(entries, seed=args.seed, progress=lambda label: bar.update(task, current=label),
                                  orphans=orphans, tp=tp, names=names, time_kernels=args.time):
                rows.append(row)
                bar.advance(task)
    if args.time:
        timing.with_peer_ratios(rows)
    if len(rows) != len(oracle_rows) + len(planned):  # a verdict or a reason for every planned row
        raise IncompleteRun(f"{len(rows) - len(oracle_rows)} rows were verified of the {len(planned)} planned; "
                            "no report written")
    wall = time.perf_counter() - start
    config = {"seed": args.seed, "modules": [e.name for e in entries], "wall_s": round(wall, 2),
              "oracle_check": oracle_check} | config
    if names is not None:
        config["implementations"] = sorted(set(names))
    if args.time:
        config["time"] = timing.clock()
    if tp is not None:
        config["tp"] = dataclasses.asdict(tp)
    return _finish(rows, config, Path(args.out), maps_dir, out, args, err=err)


def _rows_on_dask(args: argparse.Namespace, planned: list, engine: Any, err: Console,
                  config: dict[str, Any]) -> list[dict]:
    """The ``planned`` rows computed on the Dask cluster ``engine`` names, in the plan's order
    (:mod:`k3verify.harness.dask_run`); what the engine records goes to ``config["engine"]``."""
    from .harness import dask_engine, dask_run

    with dask_engine.dask_client(engine) as client, _progress(err) as bar:
        task = bar.add_task("verifying on Dask", total=len(planned), current="")
        rows, config["engine"] = dask_run.run_rows(
            planned, client, seed=args.seed, retries=engine.retries, row_timeout=engine.task_timeout,
            plugin_timeout=args.timeout,
            status=_dask_status(bar, task, err, "k3verify run",
                                lambda i: f"{planned[i][1].label} on {planned[i][2]}"))
    return rows


def _in_direction(entries: list[registry.ModuleEntry], direction: str) -> list[registry.ModuleEntry]:
    """The entries of ``direction`` (``both``: all); a usage error naming what was selected when
    none is left."""
    kept = [e for e in entries if direction in ("both", e.direction)]
    if not kept:
        names = ", ".join(e.name for e in entries)
        raise UsageError(f"--direction {direction}: none of the selected modules ({names}) has a {direction} pass")
    return kept


# Where `run` looks for the goldens its oracle is checked against when --goldens is not given.
DEFAULT_GOLDENS = Path("golden")


def _oracle_check(args: argparse.Namespace, entries: list, tp: TPOptions | None,
                  err: Console) -> tuple[list[dict], str]:
    """The ``oracle`` rows a run starts with (today's oracle on every golden file of the selected
    modules against the stored outputs, after the folder checks out) and what the report says
    of them; none for ``--tp`` runs (their reference is the unsharded layer) or ``--goldens none``."""
    if tp is not None:
        return [], "not made: a --tp run's reference is the unsharded layer"
    if args.goldens == "none":
        return [], "not made: --goldens none"
    folder = Path(args.goldens) if args.goldens else DEFAULT_GOLDENS
    if args.goldens is None and not (folder / golden.MANIFEST).is_file():
        _say(err, f"note: the oracle is not checked against goldens: no {folder / golden.MANIFEST} here "
                  "(--goldens DIR names a golden folder)")
        return [], f"not made: no {folder / golden.MANIFEST}"
    rows = golden.oracle_rows(golden.snapshot(folder), modules=[e.name for e in entries])
    return rows, f"{len(rows)} golden files of {folder}"


def _tp_options(args: argparse.Namespace) -> TPOptions | None:
    """The ``--tp`` options, or ``None`` for the usual rows; :class:`UsageError` for an impossible set."""
    if args.tp is None:
        for flag, value in (("--tp-backend", args.tp_backend), ("--tp-size", args.tp_size)):
            if value is not None:
                raise UsageError(f"{flag} needs --tp N")
        return None
    try:
        options = TPOptions(args.tp, backend=args.tp_backend or default_backend(args.tp),
                            size=args.tp_size or "small", timeout_s=args.tp_timeout)  # fmt: skip
        check_machine(options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return options


def _finish(rows: list[dict], config: dict, out_dir: Path | None, maps_dir: Path | None, out: Console,
            args: argparse.Namespace, err: Console | None = None, title: str = "k3verify run",
            extra_files: dict[str, Any] | None = None) -> int:
    """Print the verdicts in ``--format``, write the report when ``out_dir`` is given; 1 on a failure.

    The table ends with what needs reading (overflows, unavailable rows grouped by reason,
    then every failed output with its reason, one line each) so a CI log's tail says what broke.
    Files beside the report that the pages leave out are named on ``err``, one line each."""
    doc = report.build(rows, environment=environment(), config=config, command=["k3verify", *sys.argv[1:]])
    paths = write_report(doc, out_dir, maps_dir=maps_dir, not_shown=_not_shown_printer(err or out),
                         map_fallbacks=_map_fallbacks(getattr(args, "maps", None), maps_dir),
                         extra_files=extra_files, figures=getattr(args, "figures", True)) \
        if out_dir is not None else []
    failed = doc["summary"]["fail"]
    _ci_outputs(args, ci_output.rows_suite(rows, title), ci_output.run_summary(title, doc))
    if args.format != "table":  # verbatim: no markup, no wrapping
        text = _strict_json(doc) if args.format == "json" else report_markdown(doc, extra_files)
        out.file.write(text + "\n")
        return 1 if failed else 0
    if not args.quiet:
        _print_table(out, rows)
        _print_speed(out, rows)
    _print_attention(out, rows)
    _say(out, " · ".join(f"{k}: {v}" for k, v in doc["summary"].items()) + f" · wall {config['wall_s']:.1f} s")
    if paths:
        _say(out, f"wrote {', '.join(str(p) for p in paths)}")
    if failed:
        _say(out, f"{failed} verdict(s) failed", style="bold red")
    return 1 if failed else 0


def _not_shown_printer(console: Console) -> Callable[[str], None]:
    """One line per file beside a report that its pages leave out (named on the page too)."""
    return lambda item: _say(console, f"k3verify: not shown in the report: {item}", style="yellow")


def _natural_width(header: Sequence[str], cells_by_row: Sequence[Sequence[str]]) -> int:
    """Columns a table of these cells needs with no cell folded (rich's borders and padding: three
    per column and one)."""
    widths = [max([len(h), *(len(str(cells[i])) for cells in cells_by_row)]) for i, h in enumerate(header)]
    return sum(widths) + 3 * len(widths) + 1


def _print_table(out: Console, rows: list[dict]) -> None:
    """The verdict table; narrower than the table needs with no cell folded, one line per row
    instead, numbers first, so no number is ever cut ("4.1…") and no word split
    ("fp64-agreemen│t")."""
    cells_by_row = report.table_rows(rows)
    if out.width < _natural_width(report.TABLE_HEADER, cells_by_row):
        _say(out, f"{'status':<18} {'err':>9} {'limit':>9} {'margin':>6}  row [output] rule")
        for cells, row in zip(cells_by_row, rows):
            c = dict(zip(report.TABLE_HEADER, cells))
            line = (f"{c['status']:<18} {c['err']:>9} {c['limit']:>9} {c['margin']:>6}  {report.row_heading(row)} "
                    f"[{c['output']}] {c['rule']}")
            _say(out, line, style=STATUS_STYLE.get(row["status"], ""))
        return
    table = Table(*report.TABLE_HEADER, title="k3verify verdicts", show_lines=False)
    for i, column in enumerate(table.columns):
        if column.header in NUMERIC_COLUMNS:  # never cut nor split a number (or a status)
            column.no_wrap = True
            column.min_width = max([len(column.header), *(len(cells[i]) for cells in cells_by_row)])
        else:  # names fold onto more lines
            column.overflow = "fold"
    for cells, row in zip(cells_by_row, rows):
        table.add_row(*map(_cell, cells[:-1]), _cell(cells[-1], STATUS_STYLE.get(row["status"], "")))
    out.print(table)


def _print_speed(out: Console, rows: list[dict]) -> None:
    """The timed kernel rows (``run --time``), one line each: verdict, median time, clock, time over the peer's."""
    timed = report.speed_rows(rows)
    if not timed:
        return
    _say(out, f"speed: {report.speed_note(rows)}", style="dim")
    _say(out, f"{'status':<18} {'margin':>6} {'median':>9} {'clock':<5} {'÷ peer':>6}  row · peer")
    for row, status, margin, median, where, ratio, peer in timed:
        _say(out, f"{status:<18} {margin:>6} {median:>9} {where:<5} {ratio:>6}  {row} · {peer}",
             style=STATUS_STYLE.get(status, ""))


def _print_attention(out: Console, rows: list[dict]) -> None:
    """Overflow explanations, unavailable rows (one line per distinct reason), then failures."""
    for row in rows:
        for line in row.get("overflow", [])[:1]:
            _say(out, f"overflow: {report.row_heading(row)}: {line}", style="yellow")
    for reason, headings in report.unavailable_groups(rows):
        _say(out, f"unavailable ({len(headings)}): {reason}", style="dim")
        for heading in headings:
            _say(out, f"  - {heading}", style="dim")
    for line in report.failure_lines(rows):
        _say(out, f"FAIL {line}", style="bold red")


@_writes("out", "--out")
def cmd_walk(args: argparse.Namespace, out: Console, err: Console) -> int:
    """The K3 stack through the policy: precision walks, serving scenarios, attribution."""
    from .harness import decoder_walk

    jobs = decoder_walk.JOBS if args.jobs is None else args.jobs
    wide = {"experts": args.experts, "distinct_layers": args.distinct_layers}
    if args.config != "wide" and any(v is not None for v in wide.values()):
        raise UsageError("--experts and --distinct-layers shape the wide stack: give them with --config wide")
    options = decoder_walk.WalkOptions(config=args.config, prompt=args.prompt, decode=args.decode, dtype=args.dtype,
                                       seed=args.seed, jobs=jobs, plant=args.plant, num_layers=args.layers,
                                       plan=args.plan, device=args.device, use=tuple(args.use or ()),
                                       **{k: v for k, v in wide.items() if v is not None})
    try:
        config = options.decoder_config()
        options.sizes()
        options.low()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.plant is not None:
        _check_plant(args.plant, config)
    _check_walk_machine(args)
    out_dir = Path(args.out)
    start = time.perf_counter()
    with _progress(err) as bar:
        task = bar.add_task("walking", total=len(jobs), current="")

        def progress(line: str) -> None:
            bar.update(task, current=line.rsplit("(", 1)[-1].split(",")[0])
            bar.advance(task)

        # One process per device: every worker would hold its own copy of the weights there.
        workers = args.workers if options.device == "cpu" else 1
        # Each finished job is kept in the partial file until the report is written: a rerun
        # after an interrupt (or a device call's time limit) runs only the jobs that are missing.
        results = decoder_walk.run_all(options, workers=workers, progress=progress,
                                       partial=partial_path(out_dir, decoder_walk.MODULE), commit=code_version(),
                                       doing=lambda what: bar.update(task, current=what))
    rows = [row for r in results for row in r.rows]
    study = decoder_walk.study_document(options, config, results)
    wall = time.perf_counter() - start
    run_config = {"seed": args.seed, "modules": [decoder_walk.MODULE], "wall_s": round(wall, 2),
                  "decoder": config.describe(), "jobs": list(jobs), "workers": workers,
                  "plan": options.low().label, "device": options.device}
    status = _finish(rows, run_config, out_dir, None, out, args, err=err, title="k3verify walk",
                     extra_files={decoder_walk.STUDY_FILE: study})
    remove_partial(out_dir, decoder_walk.MODULE)
    return status


def _job_list(text: str) -> tuple[str, ...]:
    """``--jobs``: comma-separated names of :data:`~k3verify.harness.decoder_walk.JOBS`."""
    from .harness.decoder_walk import JOBS

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in JOBS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown job(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                                         f"known: {', '.join(JOBS)}")
    return tuple(dict.fromkeys(names))


def _plant(text: str) -> tuple[int, str]:
    """``--plant LAYER:MODULE`` (a planted bug for the first-divergence search)."""
    layer, _, module = text.partition(":")
    try:
        index = int(layer)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER:MODULE, e.g. 47:moe") from None
    if module not in ("kda", "mla", "dense", "moe"):
        raise argparse.ArgumentTypeError(f"{text!r}: the module is one of kda, mla, dense, moe")
    return index, module


def _check_walk_machine(args: argparse.Namespace) -> None:
    """``UsageError`` for a walk this machine cannot run: K3's widths on the CPU (tens of GB of
    fp64 weights: the worker is killed for memory), our kernels in a dtype Triton's CPU
    interpreter does not compute faithfully."""
    if torch.device(args.device).type != "cpu":
        return
    if args.config == "wide":
        raise UsageError("--config wide holds K3's widths (d 7168, 96 heads), tens of GB in fp64: run it with "
                         "--device cuda")
    if args.plan == "kernels":
        from .triton_support import unavailable_reason

        reason = unavailable_reason("the kernel plan", args.dtype, (torch.float32, torch.bfloat16, torch.float16))
        if reason:
            raise UsageError(f"--plan kernels --dtype {args.dtype}: {reason}")


def _check_plant(plant: tuple[int, str], config: Any) -> None:
    """``UsageError`` for a ``--plant`` the stack does not have: a layer past its last, or a
    module that layer does not run (a bug planted nowhere would leave "no divergence" reading
    as a search that missed it)."""
    layer, module = plant
    if not 0 <= layer < config.num_layers:
        raise UsageError(f"--plant {layer}:{module}: the stack has layers 0 to {config.num_layers - 1}")
    runs = (config.token_mixer(layer), config.channel_mixer(layer))
    if module not in runs:
        raise UsageError(f"--plant {layer}:{module}: layer {layer} runs {runs[0]} and {runs[1]}")


@_writes("out", "--out")
def cmd_overflow_map(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Sweep the overflow map of each selected module (``all``: every module that has one) and
    write its JSON, PNGs and studies; 1 if any cell disagrees with its prediction away from the frontier.
    With ``--engine dask`` the cells are computed on a Dask cluster (:mod:`k3verify.harness.dask_engine`)."""
    names = [n.strip() for n in _module_list([args.module]) or []]
    if names == ["all"]:
        entries = [e for e in registry.select(None) if e.overflow_map is not None]
    elif "all" in names:
        raise UsageError(f"--module {args.module!r}: 'all' stands alone (every module with a map), "
                         "not in a list of modules")  # fmt: skip
    else:
        entries = registry.select(names)
        without = [e.name for e in entries if e.overflow_map is None]
        if without:
            raise UsageError(f"module(s) {', '.join(without)} have no overflow map")
    check_output_folder(Path(args.out), "--out")
    engine = _dask_engine(args, "--cell-timeout")
    if engine is not None:
        return _overflow_maps_on_dask(args, entries, engine, out, err)
    failed = False
    for entry in entries:
        start = time.perf_counter()
        with _progress(err) as bar:
            task = bar.add_task(f"{entry.name} overflow map", total=None, current="")
            result = sweep_map(entry, MapOptions(quick=args.quick, seed=args.seed),
                               lambda done, total, t=task: bar.update(t, completed=done, total=total),
                               lambda text, t=task: bar.update(t, current=text))
        result.meta["wall_s"] = round(time.perf_counter() - start, 2)
        paths = write_map(result, Path(args.out), environment())
        counts = agreement(result.cells)
        failed |= counts["disagree_away"] > 0
        _say(out, f"{entry.name}: {len(result.cells)} cells in {result.meta['wall_s']:.1f} s; prediction vs "
                  f"observation: {counts['agree']} agree, {counts['disagree_adjacent']} disagree next to the frontier, "
                  f"{counts['disagree_away']} disagree away from it")
        for p in paths:
            _say(out, f"wrote {p}")
    return 1 if failed else 0


def _dask_engine(args: argparse.Namespace, timeout_flag: str) -> Any:
    """The ``DaskOptions`` of ``--engine dask`` (``None`` for the local engine); ``UsageError`` for
    Dask options without it, both ``--scheduler`` and ``--workers``, or dask not installed.
    ``timeout_flag`` names the command's task timeout (``--cell-timeout``, ``--row-timeout``)."""
    dask_only = {"--scheduler": args.scheduler, "--workers": args.workers, "--retries": args.retries,
                 timeout_flag: args.task_timeout}
    if args.engine == "local":
        given = [name for name, value in dask_only.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only with --engine dask")
        return None
    from .harness import dask_engine

    if args.scheduler is not None and args.workers is not None:
        raise UsageError("give --scheduler (an existing cluster) or --workers (a local one), not both")
    dask_engine.require_dask()
    return dask_engine.DaskOptions(scheduler=args.scheduler, workers=args.workers,
                                   retries=dask_engine.DEFAULT_RETRIES if args.retries is None else args.retries,
                                   task_timeout=args.task_timeout)


def _overflow_maps_on_dask(args: argparse.Namespace, entries: list, engine: Any, out: Console, err: Console) -> int:
    """``cmd_overflow_map`` with the cells computed on one Dask cluster for all ``entries``: each
    map's finished cells kept in ``<out>/.partial/<module>.jsonl`` until its files are written."""
    from .harness import dask_engine

    out_dir = Path(args.out)
    failed = False
    with dask_engine.dask_client(engine) as client:
        for entry in entries:
            start = time.perf_counter()
            with _progress(err) as bar:
                task = bar.add_task(f"{entry.name} overflow map", total=None, current="")
                result = dask_engine.run_sweep(
                    entry, MapOptions(quick=args.quick, seed=args.seed), client, retries=engine.retries,
                    cell_timeout=engine.task_timeout, partial=partial_path(out_dir, entry.name),
                    commit=code_version(), status=_dask_status(bar, task, err, f"{entry.name} overflow map"),
                    doing=lambda what, task=task, bar=bar: bar.update(task, current=what))
            result.meta["wall_s"] = round(time.perf_counter() - start, 2)
            paths = write_map(result, out_dir, environment())
            remove_partial(out_dir, entry.name)
            counts = agreement(result.cells)
            failed |= counts["disagree_away"] > 0
            e = result.meta["engine"]
            _say(out, f"{entry.name}: {len(result.cells)} cells in {result.meta['wall_s']:.1f} s on {e['workers']} "
                      f"Dask workers ({e['computed']} computed, {e['resumed']} from the partial file, {e['failed']} "
                      f"failed, {e['retried']} retried); prediction vs observation: {counts['agree']} agree, "
                      f"{counts['disagree_adjacent']} disagree next to the frontier, {counts['disagree_away']} "
                      "disagree away from it")
            for p in paths:
                _say(out, f"wrote {p}")
    return 1 if failed else 0


def _dask_status(bar: Progress | LineProgress, task: int, err: Console, what: str,
                 label: Callable[[int], str] | None = None) -> Callable[[Any], None]:
    """The Dask run's status on ``bar`` (tasks done of all, cells or rows as ``status.unit``
    says; failed, retried and the ETA beside it), each failed task as a line (``label(index)``
    names it; default: its unit and index); in a log (``bar`` a :class:`LineProgress`) its lines,
    one per 10% of the tasks with the same counts, and "still running" while none ends."""
    shown = {"failures": 0}

    def update(status: Any) -> None:
        for index, reason in status.failures[shown["failures"]:]:
            _say(err, f"{what}: {label(index) if label else f'{status.unit} {index}'} failed: {reason}",
                 style="yellow")
        shown["failures"] = len(status.failures)
        if isinstance(bar, LineProgress):  # its lines, and its "still running" while no cell ends
            bar.update(task, completed=status.done, total=status.total, unit=status.unit, detail=status.text())
            return
        bar.update(task, completed=status.done, total=status.total, current=status.text())

    return update


def cmd_list(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Registered modules and what a run would verify, with where each implementation comes from
    (``--json``: one object per implementation, for scripts)."""
    selected = _module_list(args.modules)
    impls = [impl for entry in registry.select(selected) for impl in entry.implementations()]
    if selected is None:
        impls += registry.orphan_implementations()
    # One availability probe each: some call their kernel once (FlashKDA's), on the device.
    listed = [{"label": i.label, "module": i.module, "implementation": i.implementation, "form": i.form,
               "dtype": i.dtype, "params": {k: str(v) for k, v in i.params.items()}, "cases": list(i.cases),
               "rule": i.rule, "source": i.source, "available": reason is None, "reason": reason}
              for i, reason in ((i, i.unavailable()) for i in impls)]
    if args.json:
        print(json.dumps(listed, indent=1))
        return 0
    header = ("module", "implementation", "form", "dtype", "params", "cases", "rule", "source", "available")
    rows = []
    for i in listed:
        params = " ".join(f"{k}={v}" for k, v in i["params"].items())
        rows.append((i["module"], i["implementation"], i["form"], i["dtype"], params, ",".join(i["cases"]), i["rule"],
                     i["source"], "yes" if i["available"] else f"no: {i['reason']}"))
    if out.width < _natural_width(header, rows):  # one line each, the reason whole
        for cells in rows:
            _say(out, " ".join(c for c in cells[:-1] if c) + f" · available: {cells[-1]}")
        return 0
    table = Table(*header)
    for cells in rows:
        table.add_row(*map(_cell, cells))
    out.print(table)
    return 0


def cmd_selftest(args: argparse.Namespace, out: Console, err: Console) -> int:
    """The mutant suite (:mod:`k3verify.harness.selftest`): the correct forms, then every planted
    bug at fp32 and bf16 through the testing API. Exit 1 when a correct form fails, a mutant is
    missed where it must be caught, or one is caught where it is declared invisible."""
    from .harness import selftest

    _check_sweep_options(args)
    modules = _module_list(args.modules)
    if modules is not None:
        registry.select(modules)  # an unknown name is a usage error, named
    bad_sweeps = _false_alarm_sweeps(args, modules or list(selftest.CONTROLS), out, err)
    if args.only == "sweep":
        return 1 if bad_sweeps else 0
    controls = [m for m in selftest.CONTROLS if modules is None or m in modules]
    total = len(selftest.DTYPES) * (len(selftest.mutants(modules)) + len(controls))
    outcomes = []
    from .testing import assert_matches_oracle

    for i, o in enumerate(selftest.run(assert_matches_oracle, modules), 1):
        outcomes.append(o)
        if not args.quiet:
            err.print(f"selftest: {i}/{total}", highlight=False)
    bad = [o for o in outcomes if not o.ok]
    if args.format == "md":
        print(selftest.markdown(outcomes))
    else:
        table = Table("module", "mutant", "dtype", "verdict", "expected", "caught by / why not")
        for o in outcomes:
            expected = "pass" if o.control else "caught" if o.expected else "missed"
            verdict = ("fail" if o.control else "caught") if o.caught else ("pass" if o.control else "missed")
            why = o.by or o.hidden
            table.add_row(*map(_cell, (o.module, o.name, o.dtype, verdict, expected, why)),
                          style="" if o.ok else "bold red")
        out.print(table)
    mutants = [o for o in outcomes if not o.control]
    print(f"mutants: {len({(o.module, o.name) for o in mutants})} · verdicts: {len(mutants)} · caught: "
          f"{sum(o.caught for o in mutants)} · controls: {len(outcomes) - len(mutants)} · not as expected: {len(bad)}")
    return 1 if bad or bad_sweeps else 0


def _check_sweep_options(args: argparse.Namespace) -> None:
    """``--drawn`` and ``--no-kernels`` shape the false-alarm sweep only: a ``UsageError`` where
    no sweep runs (``--only mutants``, or ``--no-kernels`` without ``--drawn`` or ``--only
    sweep``), instead of an option silently dropped."""
    given = [flag for flag, on in (("--drawn", args.drawn is not None), ("--no-kernels", args.no_kernels)) if on]
    if given and args.only == "mutants":
        raise UsageError(f"{', '.join(given)}: the sweep's options, and --only mutants runs no sweep")
    if args.no_kernels and args.drawn is None and args.only != "sweep":
        raise UsageError("--no-kernels: the sweep's option; give --drawn N or --only sweep to run the sweep")


def _false_alarm_sweeps(args: argparse.Namespace, modules: list[str], out: Console, err: Console) -> int:
    """With ``--drawn N`` (or ``--only sweep``): every module's correct implementations on its
    built-in cases and ``N`` drawn ones (:func:`selftest.sweep`); prints one line per module and
    every failure, and returns how many failed."""
    from .harness import selftest

    if args.drawn is None and args.only != "sweep":
        return 0
    failed = 0
    for module in modules:
        say = None if args.quiet else (lambda s: _say(err, s))
        result = selftest.sweep(module, args.drawn or 0, kernels=not args.no_kernels, progress=say)
        failed += len(result.failures)
        print(f"false alarms: {module}: {len(result.failures)} of {result.verdicts} verdicts "
              f"({result.drawn} drawn cases, {result.unavailable} unavailable rows, "
              f"{len(result.findings)} pinned findings)")
        for label, case, reason in result.failures:
            _say(out, f"  FAIL {label} on {case}: {reason}")
        for label, case, reason in result.findings:
            _say(out, f"  finding (pinned, a real loss) {label} on {case}: {reason}")
    return failed


@_writes("dir", "--dir")
def cmd_golden_generate(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Write every selected module's golden inputs and fp64 oracle outputs, and the manifest."""
    start = time.perf_counter()
    manifest = golden.generate(
        Path(args.dir), modules=_module_list(args.modules), seed=args.seed, progress=lambda s: _say(err, s)
    )
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values())
    for rel, record in files.items():
        _say(out, f"{rel}: {record['bytes'] / 1e3:.0f} kB, {len(record['tensors'])} tensors")
    _say(out, f"wrote {len(files)} golden files ({total / 1e6:.2f} MB) and {Path(args.dir) / golden.MANIFEST} "
              f"in {time.perf_counter() - start:.1f} s")
    return 0


@_writes("out", "--out")
def cmd_golden_verify(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Check every golden file's hash, then judge every implementation on the goldens."""
    start = time.perf_counter()
    directory = Path(args.dir)
    modules = _module_list(args.modules)
    registry.select(modules)  # an unknown name is a usage error before anything is read
    if not directory.is_dir():  # a wrong path (exit 2), not goldens that failed to verify (1)
        raise UsageError(f"--dir {args.dir[:200]!r} is not a folder")
    goldens = golden.snapshot(directory)  # read once: the rows are judged on the bytes the check passes
    problems = golden.check(goldens)
    if problems:
        for p in problems:
            _say(err, f"k3verify: golden: {p}")
        _say(err, f"{len(problems)} problem(s): {directory} is not what `k3verify golden generate` wrote",
             style="bold red")
        return 1
    _say(out, f"goldens: every file, field and digest in {directory / golden.MANIFEST} checks out")
    rows = []
    with _progress(err) as bar:
        task = bar.add_task("verifying goldens", total=None, current="")
        for row in golden.verify_rows(goldens, modules=modules,
                                      progress=lambda label: bar.update(task, current=label)):
            rows.append(row)
    config = {"goldens": str(directory), "modules": sorted({r["module"] for r in rows}),
              "wall_s": round(time.perf_counter() - start, 2)}
    return _finish(rows, config, Path(args.out) if args.out else None, None, out, args, err=err,
                   title="k3verify golden verify")


def cmd_report_compare(args: argparse.Namespace, out: Console, err: Console) -> int:
    """What got worse from BASE to NEW; exit 1 on a regression."""
    thresholds = compare.Thresholds(
        error_growth=args.error_growth, margin_drop=args.margin_drop, error_factor=args.error_factor
    )
    result = compare.compare_paths(Path(args.base), Path(args.new), thresholds, modules=_module_list(args.modules),
                                   strict_coverage=args.strict_coverage)
    groups = result.groups()
    n = len(groups["regressions"])
    _ci_outputs(args, ci_output.findings_suite(result.findings, f"k3verify report compare {args.base} {args.new}",
                                               result.rows_compared),
                compare.markdown(result, args.base, args.new))
    if args.format == "json":
        out.file.write(_strict_json({"base": args.base, "new": args.new, "rows_compared": result.rows_compared,
                                     "cells_compared": result.cells_compared, "notes": result.notes,
                                     **{k: [vars(f) for f in v] for k, v in groups.items()}}) + "\n")  # fmt: skip
    elif args.format == "md":
        out.file.write(compare.markdown(result, args.base, args.new) + "\n")
    else:
        for note in result.notes:
            _say(out, f"note: {note}", style="dim")
        shown = [f for key in ("changes", "improvements", "regressions") for f in groups[key]]
        if shown:
            table = Table("", "kind", "what", "detail", title=_cell(f"{args.base} -> {args.new}"))
            for column in table.columns:
                column.overflow = "fold"
            for f in shown:
                mark = _cell("REGRESSION", "bold red") if f.regression else _cell("info", "dim")
                table.add_row(mark, *map(_cell, (f.kind, f.subject, f.detail)))
            out.print(table)
        if groups["within_thresholds"]:
            _say(out, f"{len(groups['within_thresholds'])} row output(s) moved within the thresholds "
                      "(--format md or json lists them)", style="dim")  # fmt: skip
        for f in groups["regressions"]:  # the log's tail names each regression on one line
            _say(out, f"REGRESSION {f.kind}: {f.subject}: {f.detail}", style="bold red")
    (err if args.format != "table" else out).print(
        f"compared {result.rows_compared} rows and {result.cells_compared} map cells: "
        + (f"[bold red]{n} regression(s)[/]" if n else "[green]no regressions[/]")
        + f", {len(result.findings) - n} other change(s)", highlight=False,
    )
    return 1 if n else 0


def _strict_json(doc: object) -> str:
    """``doc`` as JSON that strict parsers accept: non-finite numbers as ``null`` (as in
    ``report.json``), objects JSON does not know as their text."""
    return json.dumps(json_safe(doc), indent=1, allow_nan=False, default=str)


@_writes("dir", "report folder")
def cmd_report_render(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Rewrite report.md and report.html of a report folder from its report.json."""
    maps_dir = _maps_dir(args.maps)
    paths = render_report(Path(args.dir), maps_dir=maps_dir, not_shown=_not_shown_printer(err),
                          map_fallbacks=_map_fallbacks(args.maps, maps_dir))
    _say(out, f"wrote {', '.join(str(p) for p in paths)}")
    return 0


# Seeds feed torch.Generator.manual_seed (64 bits) after small offsets per case.
SEED_LIMIT = 2**62


def _integer(text: str, low: int, high: int, shown: str) -> int:
    """``text`` as an integer in [low, high]; argparse's error naming ``shown`` otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{text[:40]} is outside {shown}")
    return value


def _bounded(low: int, high: int, unit: str = "") -> Callable[[str], int]:
    """An option's type: an integer in [low, high] (:func:`_integer`), ``unit`` named in the error."""
    shown = f"[{low}, {high}]" + (f" {unit}" if unit else "")

    def parse(text: str) -> int:
        return _integer(text, low, high, shown)

    return parse


_walk_tokens, _walk_decode, _walk_layers = _bounded(4, 4096), _bounded(0, 1024), _bounded(1, 93)
# walk --workers, --experts (the wide stack's routed experts), --distinct-layers (weight sets per
# module type: one per layer at most).
_walk_workers, _walk_experts = _bounded(1, 64, "worker processes"), _bounded(1, 1024, "experts")
_walk_weight_sets = _bounded(1, 93, "weight sets")


def _walk_device(text: str) -> str:
    """``walk --device``: a device torch names and this machine has."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text[:80]!r}: this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: the stack runs on cpu or cuda")
    return text


def _seed(text: str) -> int:
    return _integer(text, 0, SEED_LIMIT - 1, "[0, 2**62)")


# --drawn: drawn cases.
_count = _bounded(0, 10_000)


# --tp: ranks (what the machine holds is checked later).
_world_size = _bounded(1, MAX_WORLD_SIZE, "ranks")


# --workers: Dask worker processes.
_workers = _bounded(1, 1024, "workers")


# --retries: how often a cell whose worker died is run again.
_retries = _bounded(0, 100)


def _timeout(text: str) -> float:
    """``--tp-timeout``, ``--timeout``: seconds in (0, MAX_TIMEOUT_S]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} is outside (0, {MAX_TIMEOUT_S:g}] seconds")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


@functools.cache  # the same every call; building it took 7 ms of each in-process command
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3verify", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="verify every registered implementation (the main job)")
    r.add_argument("--modules", action="append", help="comma-separated module names (default: all)")
    r.add_argument("--out", default="reports/latest", help="report folder (default: reports/latest)")
    r.add_argument("--seed", type=_seed, default=0, help="seed of the generated cases (default: 0)")
    r.add_argument("--maps", help=MAPS_HELP)
    r.add_argument("--no-figures", dest="figures", action="store_false",
                   help="write report.html without figures or map images (drawing them is about a third of a "
                        "default run on two cores); `k3verify report render` on the folder draws them later")
    r.add_argument("--direction", choices=("forward", "backward", "both"), default="both",
                   help="the forward outputs, the gradients of the backward passes (kda_backward, mla_backward, "
                        "attnres_backward, moe_backward), or both (default)")
    r.add_argument("--tp", type=_world_size, metavar="N",
                   help="instead of the usual rows: every module's layer sharded over N ranks (fp64, and bf16 "
                        "with the all-reduce in fp32 and in bf16) against the unsharded layer")
    r.add_argument("--tp-backend", choices=BACKENDS,
                   help="collective backend for --tp (default: nccl with a CUDA device per rank, else gloo)")
    r.add_argument("--tp-size", choices=SIZES, help="layer widths for --tp: small (default) or k3 (K3's widths)")
    r.add_argument("--tp-timeout", type=_timeout, default=300.0, metavar="SECONDS",
                   help="a module's ranks that take longer fail its rows (default 300)")
    r.add_argument("--implementations", action="append", metavar="NAMES",
                   help="comma-separated implementation names: only their rows (default: every implementation; "
                        "a compare against a full baseline then counts the others as removed)")
    r.add_argument("--goldens", metavar="DIR",
                   help="golden folder whose stored fp64 outputs the oracle must reproduce before any row is "
                        f"judged (default: {DEFAULT_GOLDENS} when it holds a manifest; none: no check)")
    r.add_argument("--time", action="store_true",
                   help="also time every kernel row that ran (median of its run on its case) and, where it "
                        "names a peer, its time over the peer's; on a CPU the times are the Triton interpreter's")
    r.add_argument("--timeout", type=_timeout, default=sandbox.DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="a plugin's call (run, predict, ...) that takes longer fails its row; its process is "
                        f"stopped (default {sandbox.DEFAULT_TIMEOUT_S:g})")
    _engine_options(r, "row")
    _output_options(r)
    r.set_defaults(fn=cmd_run)
    w = sub.add_parser("walk", help="the K3 stack (93 layers) through the policy: precision walks, serving "
                                    "scenarios, attribution (docs/decoder.md)")
    w.add_argument("--out", default="reports/walk", help="report folder (default: reports/walk)")
    w.add_argument("--prompt", type=_walk_tokens, default=64, help="prompt tokens T (default: 64)")
    w.add_argument("--decode", type=_walk_decode, default=8, help="decode steps after the prompt (default: 8)")
    w.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="the low precision (default: bf16)")
    w.add_argument("--seed", type=_seed, default=0, help="seed of the weights and tokens (default: 0)")
    w.add_argument("--jobs", metavar="NAMES", type=_job_list,
                   help="comma-separated jobs (default: all): walks, attribution and the serving scenarios "
                        "prefill_decode, chunked_prefill, mixed_batch, speculative, page_placement")
    w.add_argument("--workers", type=_walk_workers, default=min(2, os.cpu_count() or 1),
                   help="worker processes (default: 2, or 1 on one core)")
    w.add_argument("--layers", type=_walk_layers, help="fewer layers than K3's 93 (a quick look; default: 93)")
    w.add_argument("--config", choices=("cpu", "wide"), default="cpu",
                   help="cpu: all layers at d = 256, 4 heads, 16 experts top 4 (default); wide: K3's widths "
                        "(d 7168, 96 heads) with --experts experts and --distinct-layers weight sets, for a GPU")
    w.add_argument("--plan", choices=("tiled", "kernels"), default="tiled",
                   help="what runs in low precision: our tiled forms (default) or our Triton kernels (a GPU for "
                        "bf16/fp16; fp32 runs in Triton's CPU interpreter)")
    w.add_argument("--device", type=_walk_device, default="cpu",
                   help="where the stack runs (default: cpu; cuda for a GPU)")
    w.add_argument("--use", action="append", metavar="LABEL",
                   help="a registered kda, mla or moe implementation (its label, as `k3verify list --json` "
                        "gives it, plugins included) in place of that module's form in the low-precision plan, "
                        "every call of it; repeatable")
    w.add_argument("--experts", type=_walk_experts, help="--config wide: routed experts (default: 16)")
    w.add_argument("--distinct-layers", type=_walk_weight_sets,
                   help="--config wide: weight sets per module type, cycled over the layers (default: 2)")
    w.add_argument("--plant", type=_plant, metavar="LAYER:MODULE",
                   help="plant a bug (output × 1.001) in one sublayer of the fp64 walk and report where the "
                        "first-divergence search finds it")
    _output_options(w)
    w.set_defaults(fn=cmd_walk)
    m = sub.add_parser("overflow-map", help="map where a module's tiled form overflows or loses precision")
    m.add_argument("--module", required=True, help="module name(s), comma-separated, e.g. kda; or all")
    m.add_argument("--out", default="reports/maps", help="output folder (default: reports/maps)")
    m.add_argument("--quick", action="store_true", help="coarse grid (seconds instead of minutes)")
    m.add_argument("--seed", type=_seed, default=0)
    _engine_options(m, "cell")
    m.set_defaults(fn=cmd_overflow_map)
    ls = sub.add_parser("list", help="list modules and implementations")
    ls.add_argument("--modules", action="append")
    ls.add_argument("--json", action="store_true", help="one JSON object per implementation")
    ls.set_defaults(fn=cmd_list)

    st = sub.add_parser("selftest", help="plant known bugs in correct forms and check that each is caught")
    st.add_argument("--modules", action="append")
    st.add_argument("--format", choices=("table", "md"), default="table", help="table (default) or md")
    st.add_argument("--quiet", action="store_true", help="no progress lines")
    st.add_argument("--drawn", type=_count, metavar="N",
                    help="also the false-alarm sweep: every correct implementation on its built-in cases "
                         "and N drawn ones")
    st.add_argument("--no-kernels", action="store_true", help="the sweep without the module's kernels")
    st.add_argument("--only", choices=("mutants", "sweep"), help="run only the mutants or only the sweep")
    st.set_defaults(fn=cmd_selftest)

    g = sub.add_parser("golden", help="golden tensors: generate, or verify hashes and implementations")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    gg = gsub.add_parser("generate", help="write golden inputs + fp64 oracle outputs and the manifest")
    gg.add_argument("--dir", default="golden", help="golden folder (default: golden)")
    gg.add_argument("--modules", action="append", help="comma-separated module names (default: all)")
    gg.add_argument("--seed", type=_seed, default=0)
    gg.set_defaults(fn=cmd_golden_generate)
    gv = gsub.add_parser("verify", help="check hashes, then every implementation against the goldens")
    gv.add_argument("--dir", default="golden", help="golden folder (default: golden)")
    gv.add_argument("--modules", action="append", help="comma-separated module names (default: all)")
    gv.add_argument("--out", help="also write report.json/.md/.html of the verdicts here")
    _output_options(gv)
    gv.set_defaults(fn=cmd_golden_verify)

    rp = sub.add_parser("report", help="compare two reports, or re-render one")
    rsub = rp.add_subparsers(dest="report_command", required=True)
    rc = rsub.add_parser("compare", help="what got worse from BASE to NEW (exit 1 on a regression)")
    rc.add_argument("base", help="base report.json or its folder (e.g. reports/baseline/cpu)")
    rc.add_argument("new", help="new report.json or its folder (e.g. reports/latest)")
    defaults = compare.Thresholds()
    rc.add_argument("--error-growth", type=_finite, default=defaults.error_growth,
                    help=f"relative error growth that counts with a margin drop (default {defaults.error_growth})")
    rc.add_argument("--margin-drop", type=_finite, default=defaults.margin_drop,
                    help=f"margin drop that counts with that growth (default {defaults.margin_drop})")
    rc.add_argument("--error-factor", type=_finite, default=defaults.error_factor,
                    help=f"error growth factor that counts on its own (default {defaults.error_factor})")
    _junit_option(rc)
    rc.add_argument("--strict-coverage", action="store_true",
                    help="a row whose optional package is missing in NEW (now unavailable) is a regression")
    rc.add_argument("--modules", action="append",
                    help="compare only these modules, comma-separated (default: every module BASE has rows or "
                         "maps of; a base module with no row in NEW is a regression)")
    rc.set_defaults(fn=cmd_report_compare)
    rc.add_argument("--format", choices=FORMATS, default="table",
                    help="table (default), md (a pull-request comment) or json (for bots) on stdout")
    rr = rsub.add_parser("render", help="rewrite report.md and report.html from report.json")
    rr.add_argument("dir", help="report folder (holding report.json)")
    rr.add_argument("--maps", help=MAPS_HELP)
    rr.set_defaults(fn=cmd_report_render)
    return p


FORMATS = ("table", "md", "json")
NUMERIC_COLUMNS = tuple(c.header for c in report.TABLE_COLUMNS if c.numeric)


def _engine_options(p: argparse.ArgumentParser, unit: str) -> None:
    """``--engine local|dask`` and the Dask engine's options, for a command whose tasks are
    ``unit``s (``cell``: ``--cell-timeout``; ``row``: ``--row-timeout``; both kept in
    ``args.task_timeout``)."""
    p.add_argument("--engine", choices=("local", "dask"), default="local",
                   help=f"where the {unit}s are computed: this process (default), or a Dask cluster, one task per "
                        f"{unit} (needs pip install 'k3verify[dask]')")
    p.add_argument("--scheduler", metavar="ADDRESS", help="--engine dask: the scheduler of an existing cluster")
    p.add_argument("--workers", type=_workers, metavar="N",
                   help="--engine dask: a local cluster of N single-threaded worker processes (default: one per core)")
    p.add_argument("--retries", type=_retries, metavar="N",
                   help=f"--engine dask: a {unit} whose worker dies is run again on a fresh one up to N times, then "
                        "failed (default 2)")
    p.add_argument(f"--{unit}-timeout", dest="task_timeout", type=_timeout, metavar="SECONDS",
                   help=f"--engine dask: a {unit} that runs longer is failed and its worker restarted (default: none)")


def _output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table (default; failures last, one line each), md or json (the whole report) on stdout")
    p.add_argument("--quiet", action="store_true", help="no table: only overflows, unavailable rows, failures "
                   "and the summary")  # fmt: skip
    _junit_option(p)


def _junit_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--junit-xml", metavar="PATH", type=_junit_path,
                   help="also write a JUnit XML file there: one test case per row (per finding for compare); "
                        f"with ${ci_output.STEP_SUMMARY} set, the Markdown summary is appended to that file too")


def _junit_path(text: str) -> Path:
    """``--junit-xml``: a file path whose folder exists (checked before anything is computed)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is a folder; give a file path")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text[:200]!r} does not exist")
    return path


def _ci_outputs(args: argparse.Namespace, suite: ET.Element, summary: str) -> None:
    """The JUnit file (``--junit-xml``) and the GitHub step summary, where asked for; a file that
    cannot be written is a usage error naming it."""
    target = getattr(args, "junit_xml", None)
    try:
        if target is not None:
            ci_output.write_junit(target, suite)
        ci_output.append_step_summary(summary)
    except OSError as exc:
        raise UsageError(f"cannot write a CI output: {exc}") from None


MAPS_HELP = (
    "folder of overflow maps and curve files shown in report.html "
    f"(default: the first non-empty of {', '.join(str(p) for p in MAPS_SEARCH)})"
)


def redeliver_interrupts(previous: Callable[[Any], object]) -> Callable[[Any], object]:
    """An unraisable-exception hook that hands a ``KeyboardInterrupt`` back to the main thread.

    A SIGINT that lands while Python runs a callback it cannot raise from (an import's module-lock
    finaliser, say) would otherwise be printed as "Exception ignored" with a traceback and then
    lost, the command running on. The interrupt is raised in the main thread again from a helper
    thread, which reaches it once the callback has returned; anything else goes to ``previous``."""

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            threading.Thread(target=_thread.interrupt_main, daemon=True).start()
            return
        previous(unraisable)

    return hook


def _check_ci_targets(args: argparse.Namespace) -> None:
    """``UsageError``, before anything is computed, for a CI output that cannot be written: a
    ``--junit-xml`` file that is one the command writes into ``--out`` (it would be written over
    the report just written, which is then lost), or a ``GITHUB_STEP_SUMMARY`` that names a
    folder or a file in a folder that does not exist (found only after the work, once)."""
    if not hasattr(args, "junit_xml"):
        return
    summary = os.environ.get(ci_output.STEP_SUMMARY)
    if summary and (Path(summary).is_dir() or not Path(summary).parent.is_dir()):
        raise UsageError(f"${ci_output.STEP_SUMMARY} names {summary[:200]!r}, which is a folder or in a folder "
                         "that does not exist")
    target, out = args.junit_xml, getattr(args, "out", None)
    if target is None or not isinstance(out, str):
        return
    own = (*report.REPORT_FILES, "decoder_walk.json")
    if target.name in own and target.resolve().parent == Path(out).resolve():
        raise UsageError(f"--junit-xml {str(target)[:200]!r} is the command's own {target.name} in --out; "
                         "give another file name")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # A log gets a wide fixed width instead of rich's 80 columns, unless COLUMNS says otherwise.
    # emoji=False: ":white_check_mark:" in a plugin's name or a report's field stays text.
    wide = {} if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else {"width": 170}
    out = OutConsole(emoji=False, **wide)
    err = Console(stderr=True, emoji=False)
    previous_hook, sys.unraisablehook = sys.unraisablehook, redeliver_interrupts(sys.unraisablehook)
    try:
        _check_ci_targets(args)
        with warnings.catch_warnings():
            # Triton's CPU interpreter computes with numpy, which warns where an emulated kernel
            # overflows; the row says so (non-finite outputs, the operand named), so the warning
            # adds a stray line to the log and nothing else.
            warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
            return args.fn(args, out, err)
    except (registry.UnknownModuleError, UsageError) as exc:
        return _error(err, str(exc), 2)
    except golden.GoldenError as exc:
        return _error(err, str(exc), 1)
    except OSError as exc:  # a full disk, a folder that vanished: name the path, keep what was there
        where = f"{exc.filename}: " if exc.filename else ""
        return _error(err, f"{where}{exc.strerror or exc}", 2)
    except KeyboardInterrupt:
        return _error(err, "interrupted; every write is atomic, so nothing was left half-written", 130)
    except Exception as exc:  # k3verify's own failure: never mistaken for a verdict (1) or a usage error (2)
        if os.environ.get("K3VERIFY_TRACEBACK"):
            traceback.print_exc()
        return _error(err, f"internal error, the command did not complete ({type(exc).__name__}: {exc}); "
                           "K3VERIFY_TRACEBACK=1 prints where", INTERNAL_ERROR)
    finally:
        sys.unraisablehook = previous_hook


# Exit status of a command that could not complete: a bug, or a run that lost rows.
INTERNAL_ERROR = 3


class IncompleteRun(RuntimeError):
    """A run that did not produce a row for every planned one (exit :data:`INTERNAL_ERROR`)."""


class OutConsole(Console):
    """The console of standard output. When its reader goes away (``k3verify run | head``) the
    command ends like any I/O error, one line and exit 2, not rich's silent exit 1 (which would
    read as a failed verdict); later prints go to /dev/null."""

    def on_broken_pipe(self) -> None:
        _discard_stdout()
        raise BrokenPipeError(errno.EPIPE, "standard output was closed before everything was printed")


def _discard_stdout() -> None:
    """Point standard output at /dev/null, so that what is still buffered or printed is dropped
    instead of failing again at every print and at exit."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())
    finally:
        os.close(null)


def _error(err: Console, message: str, code: int) -> int:
    _say(err, f"k3verify: error: {message}")
    return code


if __name__ == "__main__":
    sys.exit(main())

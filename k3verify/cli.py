"""The ``k3verify`` command line.

    k3verify run [--modules kda,mla] [--out reports/latest] [--seed 0]
    k3verify overflow-map --module kda [--out reports/maps] [--quick]
    k3verify list [--modules ...]

Exit status: 0 when every verdict passes (a predicted and observed overflow counts as
agreement, an unavailable implementation is reported but is not a verdict), 1 when any
verdict fails, 2 for usage errors such as an unknown module.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .harness import registry, report, runner
from .harness.environment import environment
from .harness.overflow_map import MapOptions, agreement, write_map

STATUS_STYLE = {"pass": "green", "fail": "bold red", "expected-nonfinite": "yellow", "unavailable": "dim"}


def _module_list(values: Sequence[str] | None) -> list[str] | None:
    """``--modules a,b --modules c`` -> ``["a", "b", "c"]`` (``None`` when not given)."""
    if values is None:
        return None
    return [name for v in values for name in v.split(",")]


class LineProgress:
    """Progress for logs (stderr not a terminal): one plain line per 10% step, with elapsed time.

    Offers the subset of ``rich.progress.Progress`` the commands use.
    """

    STEP = 0.1

    def __init__(self, console: Console):
        self.console = console
        self.tasks: dict[int, dict] = {}

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: object) -> int:
        self.tasks[len(self.tasks)] = dict(
            description=description, total=total, completed=0, shown=-1.0, start=time.perf_counter(), current=""
        )
        return len(self.tasks) - 1

    def update(
        self, task: int, *, completed: float | None = None, total: float | None = None, current: str | None = None
    ) -> None:
        t = self.tasks[task]
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["completed"] = completed
        if current is not None:
            t["current"] = current
        self._maybe_print(t)

    def advance(self, task: int, amount: float = 1) -> None:
        self.update(task, completed=self.tasks[task]["completed"] + amount)

    def _maybe_print(self, t: dict) -> None:
        if not t["total"]:
            return
        fraction = t["completed"] / t["total"]
        if fraction - t["shown"] >= self.STEP or (fraction >= 1 and t["shown"] < 1):
            t["shown"] = fraction
            elapsed = time.perf_counter() - t["start"]
            self.console.print(
                f"{t['description']}: {t['completed']:.0f}/{t['total']:.0f} "
                f"({100 * fraction:.0f}%) after {elapsed:.1f} s",
                highlight=False,
            )


def _progress(console: Console) -> Progress | LineProgress:
    """A live bar on a terminal, periodic lines in a log."""
    if not console.is_terminal:
        return LineProgress(console)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[current]}", style="dim"),
        console=console,
        transient=False,
    )


def cmd_run(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Verify every registered implementation of the selected modules; write the report."""
    entries = registry.select(_module_list(args.modules))
    planned = runner.plan(entries)
    rows = []
    start = time.perf_counter()
    with _progress(err) as bar:
        task = bar.add_task("verifying", total=len(planned), current="")
        for row in runner.run(entries, seed=args.seed, progress=lambda label: bar.update(task, current=label)):
            rows.append(row)
            bar.advance(task)
    wall = time.perf_counter() - start
    doc = report.build(
        rows,
        environment=environment(),
        config={"seed": args.seed, "modules": [e.name for e in entries], "wall_s": round(wall, 2)},
        command=["k3verify", *sys.argv[1:]],
    )
    json_path, md_path = report.write(doc, Path(args.out))
    _print_table(out, rows)
    summary = doc["summary"]
    out.print(" · ".join(f"{k}: {v}" for k, v in summary.items()) + f" · wall {wall:.1f} s")
    out.print(f"wrote {json_path} and {md_path}")
    failed = summary["fail"]
    if failed:
        out.print(f"[bold red]{failed} verdict(s) failed[/]")
    return 1 if failed else 0


def _print_table(out: Console, rows: list[dict]) -> None:
    table = Table(*report.TABLE_HEADER, title="k3verify verdicts", show_lines=False)
    for cells, row in zip(report.table_rows(rows), rows):
        style = STATUS_STYLE.get(row["status"], "")
        table.add_row(*cells[:-1], f"[{style}]{cells[-1]}[/]")
    out.print(table)
    for row in rows:
        for line in row.get("overflow", [])[:1]:
            out.print(f"[yellow]{row['module']} {row['form']} {row['dtype']} {report.params_text(row)}:[/] {line}")
        if row["status"] in ("fail", "unavailable") and row.get("reason"):
            out.print(f"[dim]{row['module']} {row['implementation']} {row['form']} {row['dtype']}: {row['reason']}[/]")


def cmd_overflow_map(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Sweep one module's overflow map and write JSON + PNG."""
    entry = registry.get(args.module)
    if entry.overflow_map is None:
        raise SystemExit(f"module {entry.name!r} has no overflow map")
    start = time.perf_counter()
    with _progress(err) as bar:
        task = bar.add_task(f"{entry.name} overflow map", total=None, current="")

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = entry.overflow_map(MapOptions(quick=args.quick, seed=args.seed), progress)
    result.meta["wall_s"] = round(time.perf_counter() - start, 2)
    paths = write_map(result, Path(args.out), environment())
    counts = agreement(result.cells)
    out.print(
        f"{entry.name}: {len(result.cells)} cells in {result.meta['wall_s']:.1f} s; prediction vs observation: "
        f"{counts['agree']} agree, {counts['disagree_adjacent']} disagree next to the frontier, "
        f"{counts['disagree_away']} disagree away from it"
    )
    for p in paths:
        out.print(f"wrote {p}")
    return 1 if counts["disagree_away"] else 0


def cmd_list(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Registered modules and what a run would verify."""
    table = Table("module", "implementation", "form", "dtype", "params", "cases", "rule", "available")
    for entry, impl, _ in {
        (e.name, i.label): (e, i, c) for e, i, c in runner.plan(registry.select(_module_list(args.modules)))
    }.values():
        reason = impl.unavailable()
        table.add_row(
            entry.name,
            impl.implementation,
            impl.form,
            impl.dtype,
            " ".join(f"{k}={v}" for k, v in impl.params.items()),
            ",".join(impl.cases),
            impl.rule,
            "yes" if reason is None else f"no: {reason}",
        )
    out.print(table)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3verify", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="verify every registered implementation (the main job)")
    r.add_argument("--modules", action="append", help="comma-separated module names (default: all)")
    r.add_argument("--out", default="reports/latest", help="report folder (default: reports/latest)")
    r.add_argument("--seed", type=int, default=0, help="seed of the generated cases (default: 0)")
    r.set_defaults(fn=cmd_run)
    m = sub.add_parser("overflow-map", help="map where a module's tiled form overflows or loses precision")
    m.add_argument("--module", required=True, help="module name, e.g. kda")
    m.add_argument("--out", default="reports/maps", help="output folder (default: reports/maps)")
    m.add_argument("--quick", action="store_true", help="coarse grid (seconds instead of minutes)")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=cmd_overflow_map)
    ls = sub.add_parser("list", help="list modules and implementations")
    ls.add_argument("--modules", action="append")
    ls.set_defaults(fn=cmd_list)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Piped output (CI logs, files) gets a wide fixed width instead of rich's 80 columns.
    out = Console() if sys.stdout.isatty() else Console(width=170)
    err = Console(stderr=True)
    try:
        return args.fn(args, out, err)
    except registry.UnknownModuleError as exc:
        err.print(f"k3verify: error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
